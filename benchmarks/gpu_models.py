"""The GPU benchmark's models and workloads (benchmarks/gpu.py runs them): each model's real config.json with
random weights that transformers builds on the device, saved once as a folder superslm.load reads; the
workloads as token ids."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

#: the real config.json of each model (Hugging Face Qwen/..., the fields a Qwen2/Qwen3 config reads)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768, max_window_layers=24,
        bos_token_id=151643, eos_token_id=151643, hidden_act="silu")),
    "qwen2.5-1.5b": ("Qwen2Config", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False, sliding_window=131072, max_window_layers=28,
        bos_token_id=151643, eos_token_id=151643, hidden_act="silu")),
    "qwen3-0.6b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False, use_sliding_window=False, sliding_window=None,
        max_window_layers=28, bos_token_id=151643, eos_token_id=151645, hidden_act="silu")),
}
#: --tiny: each config shrunk (the family's quirks kept: q/k/v biases, q/k norms, head_dim != dim / heads)
TINY: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=1),
    "qwen3-0.6b": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}
TINY_COMMON = dict(vocab_size=512, num_hidden_layers=2, max_window_layers=2, bos_token_id=511, eos_token_id=511)
WORKLOADS = ("decode1", "batch64", "batch256", "nano")


@dataclass
class Workload:
    key: str
    label: str
    prompts: list[list[int]]
    outputs: list[int]


def make_config(name: str, tiny: bool) -> Any:
    cls_name, kwargs = CONFIGS[name]
    if tiny:
        kwargs = {**kwargs, **TINY_COMMON, **TINY[name]}
    return getattr(transformers, cls_name)(**kwargs)


def make_workloads(keys: list[str], vocab: int, tiny: bool, quick: bool) -> list[Workload]:
    rng = random.Random(0)
    hi = vocab - 1 if tiny else 10000

    def batch(key: str, n: int, prompt: int, out: int) -> Workload:
        prompts = [[rng.randint(0, hi) for _ in range(prompt)] for _ in range(n)]
        return Workload(key, f"b{n} {prompt}+{out}", prompts, [out] * n)

    out: list[Workload] = []
    for key in keys:
        if key == "decode1":
            out.append(batch(key, 1, 16, 16) if tiny else batch(key, 1, 128, 128 if quick else 256))
        elif key in ("batch64", "batch256"):
            n = int(key[5:])
            out.append(batch(key, n // 32, 8, 8) if tiny else batch(key, n, 128, 64 if quick else 256))
        elif key == "nano":
            # nano-vllm's bench.py draw order: every prompt, then every max_tokens
            n, lo, top = (8, 4, 16) if tiny else (256, 100, 1024)
            r = random.Random(0)
            prompts = [[r.randint(0, hi) for _ in range(r.randint(lo, top))] for _ in range(n)]
            outputs = [r.randint(lo, top) for _ in range(n)]
            if quick:
                prompts, outputs = prompts[:64], outputs[:64]
            out.append(Workload(key, f"nano-vllm x{len(prompts)}", prompts, outputs))
    return out


def weight_bytes(net: torch.nn.Module) -> int:
    """Bytes one decode step reads of the weights: every layer's tensors, the final norm and the head (a tied
    head is the embedding, read whole for the logits); the embedding lookup itself reads one row."""
    mods = list(net.layers) + ([net.head] if getattr(net, "has_head", False) else [])
    tensors = [t for m in mods for t in (*m.parameters(), *m.buffers())]
    if getattr(net, "norm_weight", None) is not None:
        tensors.append(net.norm_weight)
    seen = {(t.data_ptr(), t.nbytes): t.nbytes for t in tensors}
    return sum(seen.values())


def build_hf(config: Any, device: torch.device, dtype: torch.dtype, tiny: bool) -> Any:
    """transformers' model of `config` with random weights, made on the device itself."""
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf = hf.to(device).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # norms start at ones: perturb them so every weight matters; tiny models get it everywhere
            # (as tests/tiny_models.py) so greedy tokens are well separated
            if tiny or "norm" in name:
                p.add_(torch.randn_like(p) * 0.08)
    hf.generation_config.eos_token_id = None  # generate to max_new_tokens: no eos stop, no eos masking
    hf.generation_config.pad_token_id = 0
    return hf


def write_folder(hf: Any, folder: Path) -> None:
    """safetensors + config.json, and a WordLevel tokenizer of the full vocabulary (ids are all we feed)."""
    hf.save_pretrained(folder, safe_serialization=True)
    vocab = hf.config.vocab_size
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    eos = hf.config.eos_token_id
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{eos}", "add_bos_token": False}))


def scratch_dir(nbytes: int) -> str | None:
    # /dev/shm when it holds the weights twice over: saving and loading then never touch a disk
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 2 * nbytes:
        return str(shm)
    return None
