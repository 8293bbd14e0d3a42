"""Speed at real sizes without real weights: a random-weight model at a published config, written as GGUF by
llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-python source distribution) and quantized
by llama.cpp's quantizer, then `superslm bench`'s figures for SuperSLM and llama.cpp on that one file, in turn,
in one run. Speed does not depend on the weights' values; the files are built once into the cache
(~/.cache/superslm/published/), never committed.

    python -m benchmarks.published --config qwen3_5-0.8b --quant Q4_K_M [--rounds 2] [--threads 2]
    python -m benchmarks.published --list
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: name -> (transformers config class, its arguments, where they come from). The tokenizer is a tiny byte-level
#: BPE (the converter pads the vocabulary to vocab_size), so prompts are longer in tokens than real text would be.
CONFIGS: dict[str, tuple[str, dict[str, Any], str]] = {
    "qwen3_5-0.8b": ("Qwen3_5TextConfig", dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
        max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}),
        "Qwen/Qwen3.5-0.8B model card: 24 layers as 6 x (3 gated delta-rule + 1 gated attention), hidden 1024, "
        "FFN 3584, attention 8 q / 2 kv heads of 256 (rotary 64), delta rule 16 qk / 16 v heads of 128, "
        "vocabulary 248,320, tied"),
    "qwen3_5-moe-1b": ("Qwen3_5MoeTextConfig", dict(
        vocab_size=248320, hidden_size=1024, num_hidden_layers=24,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, shared_expert_intermediate_size=1024,
        max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}),
        "no published MoE of this size: Qwen3.5-0.8B's layers with Qwen3.5-35B-A3B's kind of MLP (routed experts, "
        "top k, a shared expert), 32 experts of 512, top 4, shared 1024: 1.8B weights, 0.7B active (the tied "
        "embedding included)"),
    "qwen2.5-0.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True), "Qwen/Qwen2.5-0.5B config.json"),
    "qwen2.5-1.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True), "Qwen/Qwen2.5-1.5B config.json"),
    "llama-3.2-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        "meta-llama/Llama-3.2-1B config.json"),
    "qwen3-4b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True), "Qwen/Qwen3-4B config.json"),
}
#: the converter option each family needs (Qwen3.5 configs declare an MTP layer the random model does not have)
_EXTRA = {"Qwen3_5TextConfig": ("--no-mtp",), "Qwen3_5MoeTextConfig": ("--no-mtp",)}


def cache_dir() -> Path:
    from superslm import hub

    return hub.cache_dir() / "published"


def build(name: str, quant: str) -> Path:
    """The GGUF of `name` quantized as `quant` (a llama.cpp type name such as Q4_K_M, IQ4_XS, Q6_K), built once."""
    import llama_cpp
    import torch
    import transformers

    from tests.llama_cpp_convert import convert
    from tests.tiny_models import write_tokenizer

    out = cache_dir() / f"{name}-{quant}.gguf"
    if out.is_file():
        return out
    cls, kwargs, _ = CONFIGS[name]
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}", None)
    if ftype is None:
        raise SystemExit(f"llama.cpp has no quantization type {quant}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        folder = Path(tmp) / "hf"
        config = getattr(transformers, cls)(**kwargs)
        torch.manual_seed(0)
        t = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder, safe_serialization=True)
        del model
        write_tokenizer(folder, 300)
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        wide = convert(folder, Path(tmp) / "model-bf16.gguf", outtype="bf16", extra=_EXTRA.get(cls, ()))
        shutil.rmtree(folder)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = 2
        partial = Path(tmp) / out.name
        if llama_cpp.llama_model_quantize(str(wide).encode(), str(partial).encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not quantize {name} as {quant}")
        partial.replace(out)  # whole or not at all
        print(f"built {out} ({out.stat().st_size / 2**20:.0f} MB) in {time.perf_counter() - t:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from superslm.bench import run_engine, summary, table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", choices=sorted(CONFIGS), help="repeatable (default: all)")
    ap.add_argument("--quant", action="append", help="llama.cpp type, repeatable (default: Q4_K_M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--build-only", action="store_true", help="build the files and stop")
    ap.add_argument("--list", action="store_true", help="the configs and where they come from")
    ns = ap.parse_args(argv)
    if ns.list:
        for name, (cls, _, source) in CONFIGS.items():
            print(f"{name:14} {cls:20} {source}")
        return 0
    failed = False
    for name in ns.config or list(CONFIGS):
        for quant in ns.quant or ["Q4_K_M"]:
            path = str(build(name, quant))
            if ns.build_only:
                continue
            args = (path, ns.threads, ns.prefill, ns.decode, ns.streams)
            done = []
            for _ in range(ns.rounds):
                rows = {engine: run_engine(engine, *args) for engine in ("superslm", "llama.cpp")}
                print(table(path, ns.threads, rows, ns.streams), flush=True)
                done.append(rows)
                failed = failed or any("error" in r for r in rows.values())
            if ns.rounds > 1:
                print(summary(done, ns.streams), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
