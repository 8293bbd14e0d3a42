"""GPTQ int4 (`quant.gptq`, `superslm convert --calibrate`): the error it minimizes, against plain rounding
of the same weights in the same format (`Int4Linear.from_dense` without a Hessian), and on SmolLM2's
first layers against the float model on text the calibration never saw."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import superslm
from superslm import calibration
from superslm.cache.kv import KVCache
from superslm.calibration import default_text
from superslm.convert import convert
from superslm.errors import InvalidArgument
from superslm.formats import native
from superslm.kernels.attention import AttnMetadata
from superslm.kernels.hadamard import rotate_activation
from superslm.quant.gptq import Calibration, gptq_int4, rotated_hessian
from superslm.quant.int4 import Int4Linear

#: GPTQ calibration and tuning run whole models layer by layer: slow
pytestmark = pytest.mark.slow


def _inputs(k: int, t: int, seed: int) -> torch.Tensor:
    """Correlated inputs [t, k] with a few large channels and two dead ones, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + 2 * torch.randn(k, k, generator=g) / k**0.5
    x = torch.randn(t, k, generator=g) @ mix
    x[:, :3] *= 12
    x[:, 5:7] = 0
    return x


def _hidden(net: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """The residual stream [n, dim] after every layer of `net`, one prefill of one sequence."""
    a, n, ps = net.arch, len(tokens), 16
    kv = KVCache(len(net.layers), -(-n // ps), ps, a.kv_heads, a.head_dim, torch.float32)
    meta = AttnMetadata.one_prompt(n, ps)
    with torch.no_grad():
        return net.run_layers(net.embed(torch.tensor(tokens)).float(), meta, kv.k, kv.v).float()


def _out_error(x: torch.Tensor, w: torch.Tensor, module: Int4Linear) -> float:
    y = x @ w.T
    return ((module(x.bfloat16()).float() - y).norm() / y.norm()).item()


@pytest.mark.parametrize("rotate", [None, 3])
@pytest.mark.parametrize("group", [32, 128])
def test_gptq_lowers_the_output_error(rotate: int | None, group: int) -> None:
    x = _inputs(256, 2048, seed=group)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    h = x.T @ x / x.shape[0]
    rtn = Int4Linear.from_dense(w, group=group, rotate=rotate)
    gptq = Int4Linear.from_dense(w, group=group, rotate=rotate, hessian=h)
    held_out = _inputs(256, 512, seed=group)[torch.randperm(512)]
    assert _out_error(held_out, w, gptq) < 0.75 * _out_error(held_out, w, rtn)
    # the same format: only the codes and group parameters differ
    assert gptq.qweight.shape == rtn.qweight.shape and gptq.describe() == rtn.describe()


def test_gptq_codes_and_refusals() -> None:
    x = _inputs(128, 512, seed=5)
    w = torch.randn(16, 128)
    codes, scale, zero = gptq_int4(w, x.T @ x, 32)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scale.dtype == zero.dtype == torch.bfloat16 and scale.shape == (16, 4)
    # dead inputs: any code, no NaN anywhere
    assert torch.isfinite(scale.float()).all() and torch.isfinite(zero.float()).all()
    with pytest.raises(InvalidArgument):
        gptq_int4(w, torch.eye(64), 32)
    with pytest.raises(InvalidArgument):
        gptq_int4(w[:, :100], torch.eye(100), 32)


def test_calibration_hooks_and_rotated_hessian() -> None:
    lin = torch.nn.Linear(128, 8)
    cal = Calibration()
    xs = [torch.randn(5, 128), torch.randn(2, 3, 128)]
    with cal.watch({"lin": lin}):
        for x in xs:
            lin(x)
    lin(torch.randn(4, 128))  # after the block: not counted
    flat = torch.cat([x.reshape(-1, 128) for x in xs]).double()
    h = cal.pop("lin")
    torch.testing.assert_close(h, (flat.T @ flat / flat.shape[0]).float())
    assert cal.pop("lin") is None
    rx = rotate_activation(flat, seed=7, block=64)
    torch.testing.assert_close(rotated_hessian(h, 7, 64), (rx.T @ rx / rx.shape[0]).float(), atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def smol_layers(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """SmolLM2's first 4 layers as int4 g128 rotated: rounded, and by GPTQ on the default text."""
    root = tmp_path_factory.mktemp("gptq")
    return {"rtn": convert(smollm2_gguf, root / "rtn", format="int4", layers=4),
            "gptq": convert(smollm2_gguf, root / "gptq", format="int4", layers=4, calibrate=True,
                            calibration_tokens=1024)}


def test_gptq_conversion_is_closer_to_the_float_model(smol_layers: dict[str, Path], smollm2_gguf: Path,
                                                      one_thread: None) -> None:
    """Hidden states after 4 layers on text the calibration never saw (this file): GPTQ's are closer to the
    float model's than rounding's; the header says how it was calibrated."""
    ref = superslm.load(smollm2_gguf, quant=None, dtype="float32", layers=4)
    tokens = ref.tokenizer.encode(Path(__file__).read_text())[:256]
    assert not set(Path(__file__).read_text().split("\n")) & set(default_text().split("\n")) - {""}
    want = _hidden(ref.net, tokens)
    err = {}
    for name, folder in smol_layers.items():
        got = _hidden(superslm.load(folder, dtype="float32").net, tokens)
        err[name] = ((got - want).norm() / want.norm()).item()
    assert err["gptq"] < 0.8 * err["rtn"], err
    cal = native.read_folder(smol_layers["gptq"]).header["calibration"]
    assert cal["method"] == "gptq" and cal["text"] == "pydoc_data.topics" and 1024 <= cal["tokens"] <= 1026
    assert cal["dtype"] == "float32"
    assert native.read_folder(smol_layers["rtn"]).header["calibration"] is None
    # `superslm info` says how a folder was made
    made = superslm.load(smol_layers["gptq"]).info()["converted"]
    assert made["calibration"] == cal and made["format"] == "int4" and made["group"] == 128
    assert "calibration" not in superslm.load(smol_layers["rtn"]).info()["converted"]


def test_calibration_refusals(smollm2_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="int4"):
        convert(smollm2_gguf, tmp_path / "a", format="int8", calibrate=True)
    with pytest.raises(InvalidArgument, match="cannot read"):
        convert(smollm2_gguf, tmp_path / "b", format="int4", calibrate=tmp_path / "missing.txt")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(InvalidArgument, match="tokens"):
        convert(smollm2_gguf, tmp_path / "c", format="int4", calibrate=short, layers=2)
    assert not any(p.name in ("a", "b", "c") for p in tmp_path.iterdir())


def test_the_dense_copy_fits_memory(smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    one_thread: None) -> None:
    """Calibration runs a dense copy of the model: float32 where it fits, else bf16 (still better than
    rounding), else a clear refusal before anything is written."""
    assert calibration.dense_dtype(10**9, 8 * 2**30) == "float32"
    assert calibration.dense_dtype(10**9, 4 * 2**30) == "bfloat16"
    with pytest.raises(InvalidArgument, match="GiB available"):
        calibration.dense_dtype(10**9, 2**30)
    params = 135_000_000
    monkeypatch.setattr(calibration, "available_memory", lambda: params * 3)  # bf16 fits, float32 does not
    dst = convert(smollm2_gguf, tmp_path / "bf16", format="int4", layers=2, calibrate=True, calibration_tokens=512)
    assert native.read_folder(dst).header["calibration"]["dtype"] == "bfloat16"
    monkeypatch.setattr(calibration, "available_memory", lambda: params)
    with pytest.raises(InvalidArgument, match="without --calibrate"):
        convert(smollm2_gguf, tmp_path / "none", format="int4", layers=2, calibrate=True)
    assert not (tmp_path / "none").exists()
