"""The face every runtime weight format shares, and the registry of formats by name.

A format is an `nn.Module` that replaces `DenseLinear`: `forward(x) -> y` in x's dtype, `out_features`,
`dequantize() -> [out, in] float32` (the weight the module actually computes with, in the model's
basis) and `describe()`. Each stores its weight in the basis it computes in: optionally rotated
(`Rotation` applied to x inside forward) and with the input dimension padded to what its kernel needs
(`k_pad`, zeros). Save/load go through `to_tensors()` -> (flat dict of tensors, JSON-able metadata)
and `load_linear(tensors, meta)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from superslm.errors import FormatError, InvalidArgument, UnsupportedModel
from superslm.formats.blocks import BlockType
from superslm.kernels.fused import Int4Weight
from superslm.kernels.hadamard import Rotation, unrotate_weight
from superslm.kernels.row_blocks import BLOCK, by_row_blocks, pad_rows

#: name -> format class
FORMATS: dict[str, type[LinearFormat]] = {}

#: version of the tensors/metadata layout written by `to_tensors`
LAYOUT_VERSION = 1


def register_format(cls: type[LinearFormat]) -> type[LinearFormat]:
    """Class decorator: make `cls` findable by its `name`."""
    FORMATS[cls.name] = cls
    return cls


def format_class(name: str) -> type[LinearFormat]:
    """The format class registered as `name` (UnsupportedModel, naming the known ones, otherwise)."""
    cls = FORMATS.get(name)
    if cls is None:
        raise UnsupportedModel(f"unknown linear format {name!r} (known: {sorted(FORMATS)})")
    return cls


def as_parts(weight: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """One weight [out, in], or several stacked along out (fused qkv, gate_up), as float32."""
    if isinstance(weight, torch.Tensor):
        parts = [weight]
    else:
        parts = list(weight)
    if not parts or any(p.dim() != 2 for p in parts) or len({p.shape[1] for p in parts}) != 1:
        raise InvalidArgument("a linear's weight is one [out, in] matrix or a list of them sharing `in`")
    return torch.cat([p.detach().float() for p in parts]) if len(parts) > 1 else parts[0].detach().float()


def as_bias(bias: torch.Tensor | Sequence[torch.Tensor | None] | None, out: int) -> torch.Tensor | None:
    """None, one bias [out] or one per part (a part without bias contributes zeros), as float32."""
    if bias is None:
        return None
    if isinstance(bias, torch.Tensor):
        b = bias.detach().float()
    else:
        if all(p is None for p in bias):
            return None
        raise InvalidArgument("pass fused biases already concatenated (one tensor [out])")
    if b.shape != (out,):
        raise InvalidArgument(f"bias has shape {tuple(b.shape)}, expected ({out},)")
    return b


def row_order(row_perm: torch.Tensor | None, n: int) -> np.ndarray | None:
    """A GGUF weight's row permutation as numpy indices (None: the file's order); InvalidArgument unless it is a
    permutation of the weight's n rows."""
    if row_perm is None:
        return None
    perm = torch.as_tensor(row_perm, dtype=torch.long).numpy()
    if perm.shape != (n,) or not np.array_equal(np.sort(perm), np.arange(n)):
        raise InvalidArgument(f"row_perm must be a permutation of {n} rows")
    return perm


def dequantize_gguf(
    raw: np.ndarray, block_type: type[BlockType], shape: Sequence[int], row_perm: torch.Tensor | None = None
) -> torch.Tensor:
    """GGUF bytes of a weight [out, in] -> float32 [out, in], rows taken in `row_perm` order if given."""
    n, k = (int(d) for d in shape)
    if block_type.n_elements(raw) != n * k:
        raise InvalidArgument(f"{block_type.name}: {raw.size} bytes do not hold a [{n}, {k}] weight")
    w = torch.from_numpy(block_type.dequantize(raw)).view(n, k)
    if row_perm is not None:
        w = w[torch.as_tensor(row_perm, dtype=torch.long)]
    return w


class LinearFormat(nn.Module):
    """Base of the runtime weight formats (see the module docstring)."""

    #: registry name
    name: ClassVar[str]
    #: dtype the kernel wants its activations in (bf16: the packed CPU kernels are fast only there)
    compute_dtype: torch.dtype = torch.bfloat16

    def __init__(
        self,
        in_features: int,
        out_features: int,
        k_pad: int,
        bias: torch.Tensor | None,
        rotation: tuple[int, int] | None,
        note: str = "",
    ) -> None:
        super().__init__()
        self.in_features, self._out, self.k_pad, self.note = in_features, out_features, k_pad, note
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        # rotation: (seed, block) over the padded input dimension
        self.rotation = None if rotation is None else Rotation(k_pad, rotation[0], rotation[1])

    @property
    def out_features(self) -> int:
        return self._out

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def, override]
        # .float() / .to(dtype) on a model must not widen packed scales: the kernels read them in bf16
        kept = {k: b.dtype for k, b in self._buffers.items() if b is not None and b.dtype == torch.bfloat16}
        out = super()._apply(fn, recurse)
        for k, dtype in kept.items():
            b = self._buffers.get(k)
            if b is not None and b.dtype != dtype:
                self._buffers[k] = b.to(dtype)
        return out

    # --- what each format provides -------------------------------------------------------------

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, k_pad] in compute_dtype (already rotated) -> [M, out_features] in compute_dtype."""
        raise NotImplementedError

    def dequantize_stored(self) -> torch.Tensor:
        """The stored weight as float32 [out, k_pad]: rotated basis, padding included."""
        raise NotImplementedError

    def _dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x times a dense copy of the stored weight in x's dtype and device, built once (each weight rounded to
        that dtype): what a format whose kernels do not run here (a folder converted on another machine, another
        device) computes with."""
        dense = getattr(self, "_dense", None)
        if dense is None or dense.dtype != x.dtype or dense.device != x.device:
            dense = self._dense = self.dequantize_stored().to(device=x.device, dtype=x.dtype)
        return F.linear(x, dense)

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The format's own tensors and metadata (the base adds shape, bias and rotation)."""
        raise NotImplementedError

    @classmethod
    def _from_state(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], **common: Any) -> LinearFormat:
        raise NotImplementedError

    @classmethod
    def from_dense(
        cls, weight: torch.Tensor | Sequence[torch.Tensor], bias: torch.Tensor | None = None, **options: Any
    ) -> LinearFormat:
        """Build from a float weight [out, in] (or a list of parts fused along out)."""
        raise NotImplementedError

    @classmethod
    def from_gguf(
        cls,
        raw: np.ndarray,
        block_type: type[BlockType],
        shape: Sequence[int],
        row_perm: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        **options: Any,
    ) -> LinearFormat:
        """A GGUF tensor [out, in] converted to this format: dequantized, rows permuted, re-quantized
        (formats that run some block types as they are override this)."""
        w = dequantize_gguf(raw, block_type, shape, row_perm)
        return cls.from_dense(w, bias, note=f"from {block_type.name}", **options)

    # --- shared --------------------------------------------------------------------------------

    def kernel_row_invariant(self) -> bool:
        """Whether the kernel that runs now gives a row's output the same bits whatever the other rows of the
        call (the packed CPU int4/int8 kernels, ours and torch's; not the Triton GEMV/GEMM, whose tiles
        follow the row count, nor BLAS)."""
        return False

    @property
    def row_invariant(self) -> bool:
        """Whether a row's output has the same bits whatever the other rows: the kernel's, and no input
        rotation (on the CPU it is a bf16 matmul with the Hadamard table, [rows * k / b, b] @ [b, b], whose
        BLAS kernel may depend on the row count). False: deterministic mode multiplies 16 rows at a time."""
        return self.kernel_row_invariant() and self.rotation is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_rotated(self.prepare_input(x), x.dtype).reshape(*x.shape[:-1], self._out)

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """`forward`'s head: x [..., in] -> [M, k_pad] in compute_dtype, padded and rotated."""
        h = x.reshape(-1, x.shape[-1]).to(self.compute_dtype)  # [M, in]
        if self.k_pad != self.in_features:
            h = F.pad(h, (0, self.k_pad - self.in_features))
        return h if self.rotation is None else self.rotation(h)

    def forward_row_blocks(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Deterministic mode's rule for a linear that is not `row_invariant`: `forward(x)`, or
        `forward_rotated(x, dtype)` for an input already rotated, 16 rows at a time (kernels/row_blocks.py);
        x [M, ...] -> [M, out]. Where the kernel takes tiles of 16 rows (`_tiles_rows`) that is one call with
        the same bits: its rows per program fixed, its input rotation row by row on that path."""
        if type(self).forward is not LinearFormat.forward or not self._tiles_rows(x):
            return by_row_blocks(self if dtype is None else (lambda rows: self.forward_rotated(rows, dtype)), x)
        n, xp = x.shape[0], pad_rows(x, BLOCK)
        h = self.prepare_input(xp) if dtype is None else xp
        return self.finish(self._matmul_tiled(h, BLOCK), x.dtype if dtype is None else dtype)[:n]

    def _tiles_rows(self, x: torch.Tensor) -> bool:
        """Whether `_matmul_tiled` runs for x (a kernel whose rows per program can be fixed)."""
        return False

    def _matmul_tiled(self, h: torch.Tensor, tile_rows: int) -> torch.Tensor:
        """`_matmul` with `tile_rows` rows per program: each row's bits those of a call of tile_rows rows."""
        raise NotImplementedError

    #: the C++ plan's kind of this format (kernels/cpu/plan_linear.h); None: the plan cannot run it
    plan_kind: ClassVar[int | None] = None

    def plan_args(self) -> tuple[list[torch.Tensor | None], list[int]] | None:
        """The C++ plan's operands of this linear (kernels.cpu_decode.build_plan): (a, b, bias, signs, hadamard,
        extra) and (kind, group, out, in, k_pad); None where the plan cannot run it here."""
        return None

    def _plan_rotation(self) -> list[torch.Tensor | None]:
        """(signs, hadamard) of the input rotation as the plan reads them, or (None, None)."""
        return [None, None] if self.rotation is None else list(self.rotation._tables(self.compute_dtype))

    def _plan_ints(self) -> list[int]:
        return [self.out_features, self.in_features, self.k_pad]

    def input_rotation(self) -> tuple[torch.Tensor, int, torch.dtype] | None:
        """(signs, block, compute dtype) when `forward` is the base's pad-rotate-matmul and rotates, so a kernel
        that makes the input may rotate it instead and call `forward_rotated`; None otherwise (no rotation, a
        format with its own forward, a hook watching the module or its rotation)."""
        rot = self.rotation
        if rot is None or type(self).forward is not LinearFormat.forward:
            return None
        if self._forward_pre_hooks or self._forward_hooks or rot._forward_pre_hooks or rot._forward_hooks:
            return None
        return rot.signs, rot.block, self.compute_dtype

    def forward_rotated(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`forward`'s tail for an input already padded, rotated and cast: h [M, k_pad] in compute_dtype ->
        [M, out] in `dtype` (the caller's fused kernel made h: kernels.fused.norm_rotate, gated_act_rotate)."""
        return self.finish(self._matmul(h), dtype)  # [M, out]

    def finish(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`forward`'s last step on the format's product y [M, out] in compute_dtype (from `_matmul`, or a fused
        kernel given `int4_weight`): the bias in float32, then the cast to `dtype`."""
        if self.bias is not None:
            y = y.float() + self.bias
        return y.to(dtype)

    def int4_weight(self) -> Int4Weight | None:
        """The weight in the int4 kernels' terms where a fused int4 GEMV may compute `_matmul` (Int4Linear off
        torch's CPU path); None for other formats."""
        return None

    def dequantize(self) -> torch.Tensor:
        """The weight this module computes with, float32 [out, in] in the model's (unrotated) basis."""
        w = self.dequantize_stored()
        if self.rotation is not None:
            w = unrotate_weight(w, self.rotation.seed, self.rotation.block)
        return w[:, : self.in_features].contiguous()

    def describe(self) -> str:
        """One line for `superslm info`: format, its options, rotation and where it came from."""
        parts = [self._describe_format()]
        if self.rotation is not None:
            parts.append(self.rotation.describe())
        if self.k_pad != self.in_features:
            parts.append(f"in {self.in_features} padded to {self.k_pad}")
        if self.note:
            parts.append(self.note)
        return ", ".join(parts)

    def _describe_format(self) -> str:
        return self.name

    def nbytes(self) -> int:
        """Bytes the module holds in memory (packed weight, scales, bias, rotation tables)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.describe()}: {self.in_features} -> {self._out}"

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(flat dict of CPU tensors, JSON-able metadata) from which `load_linear` rebuilds the module."""
        tensors, meta = self._state()
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        if self.bias is not None:
            tensors["bias"] = self.bias.detach().cpu().contiguous()
        meta = dict(
            meta, format=self.name, layout=LAYOUT_VERSION, in_features=self.in_features,
            out_features=self._out, k_pad=self.k_pad, note=self.note,
            rotation=None if self.rotation is None else {"seed": self.rotation.seed, "block": self.rotation.block},
        )
        return tensors, meta


def load_linear(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> LinearFormat:
    """Rebuild a format module from `LinearFormat.to_tensors()` output (FormatError when inconsistent)."""
    if meta.get("layout") != LAYOUT_VERSION:
        raise FormatError(f"linear layout version {meta.get('layout')!r}, this SuperSLM reads {LAYOUT_VERSION}")
    cls = format_class(str(meta.get("format")))
    rot = meta.get("rotation")
    try:
        common = dict(
            in_features=int(meta["in_features"]), out_features=int(meta["out_features"]), k_pad=int(meta["k_pad"]),
            bias=tensors.get("bias"), rotation=None if rot is None else (int(rot["seed"]), int(rot["block"])),
            note=str(meta.get("note", "")),
        )
        module = cls._from_state(tensors, meta, **common)
    except (KeyError, TypeError, ValueError, RuntimeError, InvalidArgument) as e:
        raise FormatError(f"{cls.name} linear: inconsistent tensors or metadata ({e})") from e
    got = (module.in_features, module.out_features, module.k_pad)
    if got != (common["in_features"], common["out_features"], common["k_pad"]):
        raise FormatError(f"{cls.name} linear: tensors give (in, out, k_pad) {got}, the metadata says otherwise")
    return module
