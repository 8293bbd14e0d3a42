"""`superslm convert` and converted folders: equal logits, atomicity under SIGKILL, tamper refusal,
LoRA merging, --layers, schemas.

References: the unconverted model in the same format (`superslm.load` of the source, plus
`quantize_linears` on the same float weights), PEFT's own adapter and transformers' tiny models,
the GGUF's published sha256 (superslm.hub), and /proc/self/maps for the memory map.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import superslm
from superslm import Request, Sampling, hub
from superslm.adapters import LoraBatch
from superslm.cache.kv import KVCache
from superslm.cli import main as cli_main
from superslm.convert import convert
from superslm.errors import FormatError, InvalidArgument, ModelNotFound
from superslm.formats import native
from superslm.kernels.attention import AttnMetadata
from superslm.models.loader import open_source
from superslm.quant import quantize_linears
from superslm.quant.int4 import cpu_block
from tests.test_engine import prompts
from tests.test_lora import make_adapter
from tests.tiny_models import SingleSequence, build_hf_model

ROOT = Path(__file__).resolve().parents[1]
TOKENS = prompts(1, seed=70, lo=24, hi=24)[0]


def logits(model: superslm.Model, tokens: list[int] = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return SingleSequence(model.net).step(tokens).float()


# tiny shapes: on a busy machine every 2-thread parallel region waits for a descheduled thread
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (HF folder, transformers model): qwen2 (tied, q/k/v biases), gemma3 (norm +1 fix,
    post norms, q/k norms, sliding windows), mistral (untied head)."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: (root / f, build_hf_model(f, root / f)) for f in ("qwen2", "gemma3", "mistral")}


# (format, convert options, quantize_linears options of the reference; None: dense fp32 reference)
CASES = {
    "dense": ("dense", {}, None),
    "bf16": ("bf16", {}, dict(body="bf16", head="bf16")),
    "int4-g128-rot": ("int4", {}, dict(body="int4", head="int8", group=128, rotate=True)),
    "int4-g32": ("int4", {"group": 32, "rotate": False}, dict(body="int4", head="int8", group=32, rotate=False)),
    "int8": ("int8", {"head": "int4", "group": 32}, dict(body="int8", head="int4", group=32, rotate=True)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["qwen2", "gemma3", "mistral"])
def test_converted_equals_unconverted(tiny, tmp_path, family, case) -> None:
    src = tiny[family][0]
    fmt, options, ref_options = CASES[case]
    dst = convert(src, tmp_path / "out", format=fmt, **options)
    # same float weights, same formats: the converted model computes exactly the same logits
    ref = superslm.load(src, quant=None, dtype="float32")
    if ref_options is not None:
        quantize_linears(ref.net, **ref_options)
    got = superslm.load(dst, dtype="float32")
    assert torch.equal(logits(got), logits(ref))
    assert superslm.quant.linear_summary(got.net) == superslm.quant.linear_summary(ref.net)
    if fmt == "bf16" and family != "qwen2":
        # the default dtype of a bf16 folder is bf16: as load(quant="bf16") (qwen2's biases differ: we
        # keep them float32, load(quant="bf16") rounds them to bf16 first)
        assert torch.equal(logits(superslm.load(dst)), logits(superslm.load(src, quant="bf16")))


def test_header_config_and_overwrite(tiny, tmp_path) -> None:
    src = tiny["qwen2"][0]
    dst = convert(src, tmp_path / "out", format="int4", group=32, seed=5)
    nf = native.read_folder(dst)
    h = nf.header
    assert (h["format"], h["group"], h["head"], h["rotation"], h["layers"]) == ("int4", 32, "int8", {"seed": 5}, 3)
    assert h["source"]["format"] == "hf" and len(h["source"]["sha256"]) == 64
    assert h["linears"]["layers.0.qkv"]["rotation"]["seed"] == 5
    assert nf.config["source_config"] == json.loads((src / "config.json").read_text())
    model = superslm.load(dst)
    assert model.arch == open_source(src).arch  # Arch survives its JSON round trip
    assert model.tokenizer.encode("The quick brown fox") == superslm.load(src).tokenizer.encode("The quick brown fox")
    with pytest.raises(InvalidArgument):
        convert(src, dst, format="int8")
    convert(src, dst, format="int8", overwrite=True)
    assert native.read_folder(dst).header["format"] == "int8"
    # --force over a file: the file goes, nothing hidden stays beside the folder (rmtree left the file)
    target = tmp_path / "afile"
    target.write_text("not a model")
    convert(src, target, format="int8", overwrite=True)
    assert target.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "out"]
    with pytest.raises(InvalidArgument):
        superslm.load(dst, quant="int4")  # a converted folder is not re-quantized at load
    # quant=None (and any non-CPU device): the stored formats dequantized into dense fp32 linears; they
    # differ from the formats only by the formats' bf16 activations (a few 2^-8 relative)
    dense = superslm.load(dst, quant=None, dtype="float32")
    assert set(superslm.quant.linear_summary(dense.net)) == {"dense float32"}
    formats = logits(superslm.load(dst, dtype="float32"))
    assert ((logits(dense) - formats).norm() / formats.norm()).item() < 0.03
    with pytest.raises(InvalidArgument):
        convert(src, tmp_path / "g", format="gguf")  # gguf blocks need a GGUF source


def _copy(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst)
    return dst


def test_tampered_folder_is_refused(tiny, tmp_path) -> None:
    dst = convert(tiny["qwen2"][0], tmp_path / "ok", format="int4", schemas={"s": _schema(tmp_path)})
    open_source(dst)
    cases = {
        "modified": lambda d: _flip_byte(d / "model.safetensors"),
        "truncated": lambda d: os.truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size - 1),
        "template": lambda d: _flip_byte(d / "tokenizer_config.json"),
        "added": lambda d: (d / "schemas" / "extra.json").write_text("{}"),
        "missing": lambda d: (d / "tokenizer.json").unlink(),
        "incomplete": lambda d: (d / "manifest.json").unlink(),
    }
    words = {"modified": "model.safetensors was modified", "truncated": "bytes, the manifest says",
             "template": "tokenizer_config.json was modified", "added": "schemas/extra.json is not part",
             "missing": "tokenizer.json is missing", "incomplete": "incomplete conversion"}
    for name, damage in cases.items():
        d = _copy(dst, tmp_path / name)
        damage(d)
        with pytest.raises(FormatError, match=words[name]):
            superslm.load(d)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # same size: only the hash can tell
    path.write_bytes(bytes(data))


def _schema(tmp_path: Path) -> Path:
    p = tmp_path / "person.schema.json"
    p.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}))
    return p


def test_cli_convert_with_schemas(tiny, tmp_path, capsys) -> None:
    src, schema = tiny["gemma3"][0], _schema(tmp_path)
    dst = tmp_path / "out"
    assert cli_main(["convert", str(src), str(dst), "--format", "int8", "--schema", f"person={schema}", "-q"]) == 0
    assert str(dst) in capsys.readouterr().out
    assert superslm.load(dst).schemas() == {"person": json.loads(schema.read_text())}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")  # JSON, but not a schema
    assert cli_main(["convert", str(src), str(tmp_path / "no"), "--schema", f"x={bad}", "-q"]) == 2
    assert not (tmp_path / "no").exists() and not list(tmp_path.glob(".no.partial-*"))


def test_layers_keep_hidden_states(tiny, tmp_path) -> None:
    src = tiny["gemma3"][0]
    full = superslm.load(src, quant=None, dtype="float32")
    want = full.engine(slots=1, context=64).hidden(TOKENS, [0] * len(TOKENS), [0, 1, 2])
    for fmt in ("dense", "int4"):
        dst = convert(src, tmp_path / fmt, format=fmt, layers=2)
        assert "norm" not in native.read_folder(dst).tensors
        if fmt == "int4":
            full = superslm.load(src, quant=None, dtype="float32")
            quantize_linears(full.net, body="int4", head="int8")
            want = full.engine(slots=1, context=64).hidden(TOKENS, [0] * len(TOKENS), [0, 1, 2])
        cut = superslm.load(dst, dtype="float32")
        assert len(cut.net.layers) == 2 and not cut.net.has_head
        got = cut.engine(slots=1, context=64).hidden(TOKENS, [0] * len(TOKENS), [0, 1, 2])
        for i in (0, 1, 2):
            assert torch.equal(got[i], want[i]), (fmt, i)
        assert len(superslm.load(dst, layers=1).net.layers) == 1
        with pytest.raises(InvalidArgument):
            superslm.load(dst, layers=3)


def _make_adapter(hf, folder: Path) -> None:
    pm = make_adapter(hf, folder, 3, rslora=True, targets=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    pm.unload()  # give the base model its own modules back


def prefill_logits(net, tokens: list[int], adapter=None) -> torch.Tensor:
    """Logits [n, vocab] float32 of one sequence in one prefill step, with a LoRA adapter on every row."""
    a, n, ps = net.arch, len(tokens), 16
    pages = (n + ps - 1) // ps
    kv = KVCache(len(net.layers), pages, ps, a.kv_heads, a.head_dim, net.dtype)
    meta = AttnMetadata.one_prompt(n, ps)
    if adapter is not None:
        meta.lora = LoraBatch([(adapter, torch.arange(n))])
    with torch.no_grad():
        return net.logits(net.run_layers(net.embed(torch.tensor(tokens)), meta, kv.k, kv.v)).float()


def test_lora_merged_equals_runtime(tiny, tmp_path) -> None:
    src, hf = tiny["qwen2"]
    _make_adapter(hf, tmp_path / "ad")
    s = Sampling(logprobs=1, ignore_eos=True)
    p = prompts(1, seed=71, lo=10, hi=10)[0]
    # fp32: merging changes only the order of float32 operations ((W + BA) x vs W x + B (A x)), a
    # relative error ~1e-6 of the logits; 1e-4 on log-probabilities leaves a margin of ~100x
    base = superslm.load(src, quant=None, dtype="float32")
    runtime = base.engine(slots=1, context=64).generate([Request(p, 6, s, adapter=base.adapter(tmp_path / "ad"))])[0]
    merged = superslm.load(convert(src, tmp_path / "m32", format="dense", lora=tmp_path / "ad"))
    folded = merged.engine(slots=1, context=64).generate([Request(p, 6, s)])[0]
    assert folded.tokens == runtime.tokens
    assert max(abs(x.logprob - y.logprob) for x, y in zip(folded.logprobs, runtime.logprobs)) <= 1e-4
    # bf16: merged rounds W + BA to bf16 once; runtime rounds W, and B (A x) runs in bf16. Neither
    # is exact, so both are measured against the fp32 merged model: merging must be no worse than
    # running the adapter at bf16 (up to one more bf16 step of the log-probabilities, 2^-8 * |lp|)
    ref = prefill_logits(merged.net, p).log_softmax(-1)
    bf = superslm.load(src, quant="bf16")
    rt = prefill_logits(bf.net, p, bf.adapter(tmp_path / "ad")).log_softmax(-1)
    m16 = superslm.load(convert(src, tmp_path / "m16", format="bf16", lora=tmp_path / "ad"))
    mg = prefill_logits(m16.net, p).log_softmax(-1)
    err_runtime, err_merged = (rt - ref).abs().max().item(), (mg - ref).abs().max().item()
    assert err_merged <= err_runtime + 2**-8 * ref.abs().max().item()
    # and the adapter is really in there: the base model is much farther away
    assert (prefill_logits(bf.net, p).log_softmax(-1) - ref).abs().max().item() > 10 * err_merged


# --- the real GGUF: blocks as they are, SIGKILL, memory map ---------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    """SmolLM2 converted: first by a `superslm convert` process killed mid-way (SIGKILL), then again."""
    dst = tmp_path_factory.mktemp("smol") / "SmolLM2"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen([sys.executable, "-m", "superslm.cli", "convert", str(smollm2_gguf), str(dst), "-q"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    # kill while the tensors are being written (a fast machine writes them in well under a second)
    while not list(dst.parent.glob(".SmolLM2.partial-*/model.safetensors")):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    killed = {"rc": proc.wait(), "dst": dst.exists(), "partials": list(dst.parent.glob(".SmolLM2.partial-*"))}
    errors = []
    for folder in [dst, *killed["partials"]]:
        try:
            superslm.load(folder)
            errors.append(None)
        except (ModelNotFound, FormatError) as e:
            errors.append(e)
    killed["errors"] = errors
    start = time.perf_counter()
    convert(smollm2_gguf, dst)
    killed["convert_s"] = time.perf_counter() - start
    killed["left"] = list(dst.parent.glob(".SmolLM2.partial-*"))
    return dst, killed


@pytest.mark.slow
def test_sigkill_leaves_nothing_loadable_and_rerun_succeeds(smol) -> None:
    dst, killed = smol
    assert killed["rc"] == -signal.SIGKILL
    assert not killed["dst"] and len(killed["partials"]) == 1
    assert isinstance(killed["errors"][0], ModelNotFound)  # nothing at the destination
    assert isinstance(killed["errors"][1], FormatError) and "incomplete" in str(killed["errors"][1])
    assert killed["left"] == []  # the rerun removed the stale partial folder
    native.verify_folder(dst)


def _mapped(path: Path) -> list[tuple[int, int]]:
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            out.append((lo, hi))
    return out


@pytest.mark.slow
def test_gguf_blocks_kept_and_load_memory_mapped(smol, smollm2_gguf) -> None:
    dst, killed = smol
    header = native.read_folder(dst).header
    assert header["format"] == "gguf" and header["head"] == "nearest"
    assert header["source"]["sha256"] == hub.KNOWN["smollm2-135m-instruct"].sha256
    start = time.perf_counter()
    got = superslm.load(dst)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    ref = superslm.load(smollm2_gguf)  # GGUF blocks run as they are (quant="auto")
    gguf_s = time.perf_counter() - start
    print(f"\nSmolLM2: convert {killed['convert_s']:.1f} s, load converted {load_s:.2f} s, load GGUF {gguf_s:.2f} s")
    tokens = ref.tokenizer.encode("The capital of France is Paris. It is known for its museums and")
    assert torch.equal(logits(got, tokens), logits(ref, tokens))
    assert superslm.quant.linear_summary(got.net) == superslm.quant.linear_summary(ref.net)
    assert got.fingerprint == ref.fingerprint  # saved sequences restore into either
    # the tokenizer written from the GGUF vocabulary is the same tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"}]
    assert got.chat_tokens(msgs) == ref.chat_tokens(msgs)
    assert got.tokenizer.decode(range(0, 49152, 97)) == ref.tokenizer.decode(range(0, 49152, 97))
    for attr in ("bos_id", "eos_id", "add_bos", "add_eos", "kind", "chat_template", "vocab_size", "special_ids"):
        assert getattr(got.tokenizer, attr) == getattr(ref.tokenizer, attr), attr
    assert got.stop_ids == ref.stop_ids
    # no copy at load: the weights live in the file's memory map (int4 codes only where torch's packed layout is
    # the stored one, blocks of 64 rows with AVX-512; with AVX2's 32 they are repacked at load)
    spans = _mapped((dst / "model.safetensors").resolve())
    qweight = got.net.layers[3].gate_up.qweight
    for t in (got.net.embed_weight, qweight, got.net.head.codes):
        assert any(lo <= t.data_ptr() < hi for lo, hi in spans) == (t is not qweight or cpu_block() == 64)


@pytest.mark.slow
def test_cli_convert_takes_a_known_model_name(smollm2_gguf, tmp_path, capsys) -> None:
    # as `--model` does elsewhere: a known name is fetched once (here: already cached) and converted
    dst = tmp_path / "smol"
    assert cli_main(["convert", "smollm2-135m-instruct", str(dst), "--layers", "2", "-q"]) == 0
    assert str(dst) in capsys.readouterr().out and (dst / "manifest.json").exists()
    assert len(superslm.load(dst).net.layers) == 2
    assert cli_main(["convert", "no-such-model", str(tmp_path / "x"), "-q"]) == 2
    assert "not a known model name" in capsys.readouterr().err


def test_a_killed_conversions_folder_goes_with_the_next_one_beside_it(tmp_path) -> None:
    """A killed convert left its hidden partial folder until a rerun to the same destination; the next
    conversion into the same folder, whatever its destination, now removes it (a live one's stays)."""
    import subprocess

    from superslm.formats import native

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process is gone
    stale = tmp_path / f".old-model.partial-{gone.pid}-0123abcd"
    live = tmp_path / f".other.partial-{os.getpid()}-89abcdef"
    unrelated = tmp_path / ".notes.partial-x"
    for folder in (stale, live, unrelated):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    with native.partial_folder(tmp_path / "new-model") as tmp:
        (tmp / "x").write_text("1")
    assert (tmp_path / "new-model" / "x").read_text() == "1"
    assert not stale.exists() and live.exists() and unrelated.exists()
