"""Which runtime format each GGUF block type becomes, and linears built from GGUF tensors.

Q4_0, Q4_1 and Q4_K run as they are ("gguf": their 32-value groups are the packed kernel's groups), and
Q5_0 too ("gguf5", quant/int5.py) where the C++ VNNI or AVX2 kernels run (else int8, as below), and IQ4_NL / IQ4_XS
("giq4", quant/iq4.py: a float32 scale times a table value per code) where the C++ IQ4 GEMV runs (AVX2), and
Q6_K ("gq6k", quant/q6k.py: the file's blocks byte for byte) where the C++ Q6_K GEMV runs (AVX2).
Q8_0 stays int8 per channel by default: as it is ("gq80", quant/q80.py, by `mapping={"Q8_0": ("gq80", {})}` where
the C++ Q8_0 GEMV runs and the VNNI kernels do not) it loads in half the time and ~30 MB lighter, but Gemma-3-270M's
tied Q8_0 head decoded at 0.92-0.95x the int8 path's speed (SmolLM2's 0.98-1.00x; benchmarks/q80_decode.py --decode,
quiet AVX2 EPYC). Every other quantized type is dequantized and re-quantized to int8 per output channel: measured on
Gemma-3-270M's tensors (relative Frobenius error of W x against the block's own values, Gaussian x),
int8 adds 0.8% (Q5_0, Q8_0) to 1.0% (Q6_K, where its kernels do not run), where int4 g32 would add 8%
(docs/quantization.md).
Float types become bf16. A caller may pass its own `mapping` (e.g. Q5_0 -> int4 g32, for speed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from superslm import cext
from superslm.errors import InvalidArgument, TokenOutOfRange
from superslm.formats.blocks import IQ4_NL, IQ4_XS, Q5_0, Q6_K, Q8_0, BlockType, Int4BlockType
from superslm.quant.base import LinearFormat, dequantize_gguf, format_class, load_linear, register_format
from superslm.quant.int4 import GGUFInt4Linear
from superslm.quant.int5 import GGUFInt5Linear, int5_kernels
from superslm.quant.iq4 import GGUFIQ4Linear, iq4_kernels
from superslm.quant.q6k import GGUFQ6KLinear, q6k_kernels
from superslm.quant.q80 import GGUFQ80Linear, q80_kernels

#: block type name -> (format name, from_dense options); the int4 block types run natively
NEAREST: dict[str, tuple[str, dict[str, Any]]] = {
    "Q4_0": ("gguf", {}), "Q4_1": ("gguf", {}), "Q4_K": ("gguf", {}),
    "Q5_0": ("gguf5", {}), "Q5_1": ("int8", {}), "Q5_K": ("int8", {}), "Q6_K": ("gq6k", {}),
    "Q8_0": ("int8", {}), "Q8_K": ("int8", {}), "Q2_K": ("int8", {}), "Q3_K": ("int8", {}),
    "IQ4_NL": ("giq4", {}), "IQ4_XS": ("giq4", {}), "IQ3_S": ("int8", {}), "IQ3_XXS": ("int8", {}),
    "IQ2_S": ("int8", {}), "IQ2_XS": ("int8", {}), "IQ2_XXS": ("int8", {}),
    "F32": ("bf16", {}), "F16": ("bf16", {}), "BF16": ("bf16", {}), "F64": ("bf16", {}),
}  # fmt: skip

#: one GGUF weight: (raw bytes, block type, shape [out, in], row permutation or None)
GGUFPart = tuple[np.ndarray, type[BlockType], Sequence[int], "torch.Tensor | None"]


def nearest_format(block_type: type[BlockType], mapping: Mapping[str, tuple[str, dict[str, Any]]] | None = None
                   ) -> tuple[str, dict[str, Any]]:
    """(format name, options) a block type runs as; InvalidArgument for types with no linear format."""
    table = {**NEAREST, **(mapping or {})}
    got = table.get(block_type.name)
    if got is None:
        raise InvalidArgument(f"GGUF {block_type.name} tensors cannot be used as a linear weight")
    if got[0] == "gguf" and not issubclass(block_type, Int4BlockType):
        raise InvalidArgument(f"GGUF {block_type.name} is not an int4 block type; it cannot run as 'gguf'")
    if got[0] == "gguf5":
        if block_type is not Q5_0:
            raise InvalidArgument(f"GGUF {block_type.name} is not Q5_0; it cannot run as 'gguf5'")
        if not int5_runs():
            return "int8", {}
    if got[0] == "giq4":
        if block_type not in (IQ4_NL, IQ4_XS):
            raise InvalidArgument(f"GGUF {block_type.name} is not IQ4_NL or IQ4_XS; it cannot run as 'giq4'")
        if not iq4_runs():
            return "int8", {}
    if got[0] == "gq6k":
        if block_type is not Q6_K:
            raise InvalidArgument(f"GGUF {block_type.name} is not Q6_K; it cannot run as 'gq6k'")
        if not q6k_runs():
            return "int8", {}
    if got[0] == "gq80":
        if block_type is not Q8_0:
            raise InvalidArgument(f"GGUF {block_type.name} is not Q8_0; it cannot run as 'gq80'")
        if not q80_runs():
            return "int8", {}
    return got


def int5_runs() -> bool:
    """Whether Q5_0 can run as it is here: the C++ 5-bit kernels built (AVX-512 VNNI, or AVX2 and FMA), and not
    SUPERSLM_KERNELS=torch."""
    return not cext.torch_kernels_forced() and int5_kernels() is not None


def iq4_runs() -> bool:
    """Whether IQ4_NL / IQ4_XS can run as they are here: the C++ IQ4 GEMV built, and not SUPERSLM_KERNELS=torch."""
    return iq4_kernels() is not None


def q6k_runs() -> bool:
    """Whether Q6_K can run as it is here: the C++ Q6_K GEMV built, and not SUPERSLM_KERNELS=torch."""
    return q6k_kernels() is not None


def q80_runs() -> bool:
    """Whether Q8_0 runs as it is here: the C++ Q8_0 GEMV built, not SUPERSLM_KERNELS=torch, and no VNNI kernels
    (with them an int8 head and body take the VNNI int8 GEMV, one instruction per 64 products, and a tied Q8_0
    head certifies greedy tokens with half the products, cpu_decode.greedy_head; gq80 is the AVX2 machines')."""
    return q80_kernels() is not None and cext.vnni() is None


def _int8_by_rows(part: GGUFPart, bias: torch.Tensor | None, note: str,
                  release: Callable[[], None] | None = None) -> LinearFormat:
    """A GGUF weight re-quantized to int8 per output channel a block of rows at a time (the same codes
    as dequantize-then-quantize; a 262k-row head never exists in float32 all at once). `release` runs
    after each block (the loader drops the file's pages read so far)."""
    from superslm.quant.dense import Int8Linear, quantize_int8

    raw, block_type, shape, _ = part
    n, k = (int(d) for d in shape)
    if k % 32 or k % block_type.block_size or block_type.n_elements(raw) != n * k:
        return format_class("int8").from_dense(dequantize_gguf(*part), bias, note=note)
    rows = raw.reshape(n, -1)  # [out, row bytes]
    codes = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.bfloat16)
    for r in range(0, n, 8192):
        chunk = np.ascontiguousarray(rows[r : r + 8192]).reshape(-1)
        w = torch.from_numpy(block_type.dequantize(chunk)).view(-1, k)
        codes[r : r + 8192], scale[r : r + 8192] = quantize_int8(w)
        if release is not None:
            release()
    return Int8Linear(codes, scale, k, n, bias=None if bias is None else bias.float(), note=note)


class GGUFEmbedding(torch.nn.Module):
    """Token embeddings read from the GGUF blocks on demand: each step's rows are dequantized from the
    file (the values `materialize` would give), so the [vocab, dim] table is never held dense. For
    Gemma-3-270M that is 335 MB of bf16 (and 670 MB of float32 while loading) not spent. With `read`
    (formats.gguf.FileRows) the rows come by pread and no page of the file enters RSS; else from the
    memory map, its pages dropped every RELEASE_ROWS rows."""

    #: rows read between two calls of `release`: a prompt's scattered rows fault in ~64 KB of the file each
    #: (7 MB for a 512-token prompt on SmolLM2), and a long session would gather the whole table in RSS
    RELEASE_ROWS = 256

    def __init__(self, raw: np.ndarray, block_type: type[BlockType], shape: Sequence[int], dtype: torch.dtype,
                 fix: Any = None, release: Callable[[], None] | None = None,
                 read: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        super().__init__()
        n, k = (int(d) for d in shape)
        if k % block_type.block_size or block_type.n_elements(raw) != n * k:
            raise InvalidArgument(f"{block_type.name}: {raw.size} bytes are not [{n}, {k}] embeddings in whole blocks")
        self.rows = raw.reshape(n, k // block_type.block_size * block_type.type_size)  # [vocab, row bytes]
        self.block_type, self.vocab, self.dim, self.dtype, self.fix = block_type, n, k, dtype, fix
        self.release, self._unreleased, self.read = release, 0, read

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] -> embeddings [N, dim] in the model dtype, on the tokens' device."""
        idx = tokens.detach().to("cpu", torch.long).numpy()
        if idx.size and (idx.min() < 0 or idx.max() >= self.vocab):
            raise TokenOutOfRange(f"token ids must be in 0..{self.vocab - 1}")
        if self.read is not None:
            raw = self.read(idx).reshape(-1)
        else:
            raw = np.ascontiguousarray(self.rows[idx]).reshape(-1)
            self._unreleased += len(idx)
            if self.release is not None and self._unreleased >= self.RELEASE_ROWS:
                self.release()  # the rows are copied: the file's pages can go (a later read faults them back)
                self._unreleased = 0
        values = torch.from_numpy(self.block_type.dequantize(raw)).view(len(idx), self.dim)
        if self.fix is not None:
            values = self.fix(values)
        return values.to(device=tokens.device, dtype=self.dtype)

    def all_finite(self, rows: int = 4096) -> bool:
        """Whether every value of the table is finite, read `rows` rows at a time (the table is never dense)."""
        for a in range(0, self.vocab, rows):
            raw = np.ascontiguousarray(self.rows[a : a + rows]).reshape(-1)
            if not np.isfinite(self.block_type.dequantize(raw).sum(dtype=np.float64)):
                return False
            if self.release is not None:
                self.release()
        return True

    def extra_repr(self) -> str:
        return f"{self.block_type.name} [{self.vocab}, {self.dim}] read from the file per step"


@register_format
class ConcatLinear(LinearFormat):
    """Parts of a fused linear that map to different formats (e.g. Q4_K q, k with a Q6_K v): one
    kernel call per part, outputs concatenated. Costs a dispatch per part; used only when needed."""

    name: ClassVar[str] = "concat"

    def __init__(self, parts: Sequence[LinearFormat], note: str = "") -> None:
        ins = {p.in_features for p in parts}
        if len(ins) != 1:
            raise InvalidArgument("concatenated linears must share their input dimension")
        k = ins.pop()
        super().__init__(k, sum(p.out_features for p in parts), k, None, None, note)
        self.parts = torch.nn.ModuleList(parts)

    @property
    def row_invariant(self) -> bool:
        return all(p.row_invariant for p in self.parts)

    def plan_args(self) -> tuple[list[torch.Tensor | None], list[int]]:
        """Kind 4 with no tensors of its own: build_plan adds each part's operands (`plan.add_part`)."""
        return [None] * 6, [4, 0, self.out_features, self.in_features, self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def forward_row_blocks(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Deterministic mode part by part, each by its own format's rule (whole where its rows are invariant, else
        its `forward_row_blocks`: a Q6_K part's 16-row tiles), so each part's bits are those the C++ plan gives it;
        16-row blocks of the whole concat took a Q6_K part's GEMV instead."""
        outs = [(p(x) if dtype is None else p.forward_rotated(x, dtype)) if p.row_invariant
                else p.forward_row_blocks(x, dtype) for p in self.parts]
        return torch.cat(outs, dim=-1)

    def dequantize_stored(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_stored()

    def describe(self) -> str:
        return "concat[" + "; ".join(p.describe() for p in self.parts) + "]"

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors: dict[str, torch.Tensor] = {}
        metas = []
        for i, p in enumerate(self.parts):
            t, m = p.to_tensors()
            tensors.update({f"part{i}.{k}": v for k, v in t.items()})
            metas.append(m)
        return tensors, {"parts": metas}

    @classmethod
    def _from_state(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], **common: Any) -> LinearFormat:
        parts = []
        for i, m in enumerate(meta["parts"]):
            prefix = f"part{i}."
            parts.append(load_linear({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, m))
        return cls(parts, common.get("note", ""))


def linear_from_gguf(
    parts: Sequence[GGUFPart],
    bias: torch.Tensor | None = None,
    mapping: Mapping[str, tuple[str, dict[str, Any]]] | None = None,
    release: Callable[[], None] | None = None,
) -> LinearFormat:
    """One linear from one GGUF weight or several fused along out (qkv, gate_up), each block type in
    its nearest format: one module when all parts map to the same format, else a ConcatLinear.
    `release`: called as a large re-quantization goes (see _int8_by_rows)."""
    if not parts:
        raise InvalidArgument("linear_from_gguf needs at least one part")
    targets = [nearest_format(p[1], mapping) for p in parts]
    if all(t == targets[0] for t in targets):
        fmt, options = targets[0]
        if fmt == "gguf":
            return GGUFInt4Linear.from_gguf_parts(parts, bias)
        if fmt == "gguf5":
            return GGUFInt5Linear.from_gguf_parts(parts, bias)
        if fmt == "giq4":
            return GGUFIQ4Linear.from_gguf_parts(parts, bias)
        if fmt == "gq6k":
            return GGUFQ6KLinear.from_gguf_parts(parts, bias, release)
        if fmt == "gq80":
            return GGUFQ80Linear.from_gguf_parts(parts, bias, release)
        names = "+".join(dict.fromkeys(p[1].name for p in parts))
        if fmt == "int8" and not options and len(parts) == 1 and parts[0][3] is None:
            return _int8_by_rows(parts[0], bias, f"from {names}", release)
        weights = [dequantize_gguf(*p) for p in parts]
        return format_class(fmt).from_dense(weights, bias, note=f"from {names}", **options)
    # runs of neighbouring parts in one format stay one module (Gemma's Q5_0 q and k beside a Q8_0 v: two kernel
    # calls a step, not three)
    runs: list[list[int]] = []
    for i, t in enumerate(targets):
        if runs and targets[runs[-1][0]] == t:
            runs[-1].append(i)
        else:
            runs.append([i])
    sizes = [sum(int(parts[i][2][0]) for i in run) for run in runs]
    biases = [None] * len(runs) if bias is None else list(torch.split(bias, sizes))
    return ConcatLinear([linear_from_gguf([parts[i] for i in run], b, mapping) for run, b in zip(runs, biases)])
