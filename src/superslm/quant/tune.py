"""int4 scales and zeros tuned end to end after GPTQ: the codes stay, each group's (scale, zero) learns from
the dense model's next-token distributions on calibration text (EfficientQAT's E2E-QP, Chen et al. 2024).

GPTQ chooses codes linear by linear against each one's inputs; the errors of 200 such choices add up through
the layers (SmolLM2: spread evenly over layers and linears, no few of them carry it). Here the dense model's
own forward pass runs twice per step over one calibration sequence: with the dense linears (the teacher,
no gradients) and with every int4 linear's weight rebuilt from its codes and trainable scale and zero (the
student, float32, in steps relative to each group's scale); Adam lowers KL(teacher || student) per token.
Scale and zero pass through bf16 rounding in the forward (straight-through), as the kernels store them.
Nothing else changes: the norms, the head and the codes keep their values, so the stored format is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from superslm.cache.kv import KVCache
from superslm.errors import InvalidArgument
from superslm.kernels.attention import AttnMetadata
from superslm.models.transformer import Transformer
from superslm.quant.int4 import Int4Linear

#: Adam's step size, relative to each group's scale (SmolLM2: 5e-5 absolute, ~6e-4 of its scales, was the
#: best of 1e-5 .. 2e-4; larger steps drift away from the teacher)
LR = 6e-4
_PAGE = 16


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bf16 in the forward pass, the identity in the backward (straight-through)."""
    return t + (t.to(torch.bfloat16).float() - t).detach()


class _Tunable(nn.Module):
    """An Int4Linear's weight from its codes and trainable scale/zero, or (teacher) the dense linear it
    was made from; it stands in the dense model's layer while tuning runs."""

    def __init__(self, quant: Int4Linear, dense: nn.Module) -> None:
        super().__init__()
        codes, scale, zero = quant._params()
        self.register_buffer("codes", codes.float() - 8)  # [N, k_pad]
        self.register_buffer("scale0", scale.float().clone())  # [N, groups]
        self.register_buffer("zero0", zero.float().clone())
        # relative steps: scale = scale0 (1 + a), zero = zero0 + scale0 b, so one learning rate means the same
        # for every model (Gemma-3's weights are 5-10x smaller than SmolLM2's; absolute steps made it drift)
        self.a = nn.Parameter(torch.zeros_like(self.scale0))
        self.b = nn.Parameter(torch.zeros_like(self.scale0))
        self.quant, self.dense, self.teacher = quant, dense, False

    def scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The current (scale, zero) float32 [N, groups], each rounded to bf16 (straight-through)."""
        return _bf16(self.scale0 * (1 + self.a)), _bf16(self.zero0 + self.scale0 * self.b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.teacher:
            return self.dense(x)
        q, g = self.quant, self.quant.group
        scale, zero = self.scale_zero()
        w = self.codes * scale.repeat_interleave(g, 1) + zero.repeat_interleave(g, 1)
        h = x.reshape(-1, x.shape[-1]).float()  # [M, in]
        if q.k_pad != q.in_features:
            h = F.pad(h, (0, q.k_pad - q.in_features))
        if q.rotation is not None:
            h = q.rotation(h)
        y = h @ w.T
        if q.bias is not None:
            y = y + q.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], q.out_features)

    def result(self) -> Int4Linear:
        """The tuned module: the same codes, rotation, bias and note, the learned scales and zeros."""
        q = self.quant
        codes = (self.codes + 8).to(torch.uint8)
        rot = None if q.rotation is None else (q.rotation.seed, q.rotation.block)
        scale, zero = (t.detach().to(torch.bfloat16) for t in self.scale_zero())
        return Int4Linear(codes, scale, zero, q.group, q.in_features, q.out_features, q.bias, rot, q.note)


def _log_probs(net: Transformer, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the logits of every position of one sequence, float32 [n, vocab]."""
    n, a = len(tokens), net.arch
    meta = AttnMetadata.one_prompt(n, _PAGE)
    # a fresh cache per pass: the student's keys enter autograd's graph, which each backward frees
    kv = KVCache(len(net.layers), -(-n // _PAGE), _PAGE, a.kv_heads, a.head_dim, net.dtype)
    h = net.run_layers(net.embed(torch.tensor(tokens)), meta, kv.k, kv.v)
    return F.log_softmax(net.logits(h), dim=-1)


def tune_int4(
    net: Transformer,
    quantized: Mapping[str, Int4Linear],
    seqs: list[list[int]],
    steps: int,
    lr: float = LR,
    report: Callable[[int, float], None] | None = None,
) -> tuple[dict[str, Int4Linear], dict[str, Any]]:
    """Tune the scales and zeros of `quantized` ({"layers.{i}.{attr}": module made from net's dense linear
    of that name}) for `steps` sequences of `seqs`, in turn, against `net` itself (dense, with its head).

    The last sequence is held out (when there are two or more): the returned info {"steps", "lr", "tokens",
    "kl_before", "kl_after"} has the mean KL per token on it before and after. `net` is left as it was.
    `report(step, kl)` is called after each step with that step's training KL.
    """
    if steps < 1 or not seqs or any(len(s) < 2 for s in seqs):
        raise InvalidArgument("tuning needs at least one step and sequences of two tokens or more")
    held = seqs[-1]
    train = seqs[:-1] or seqs
    if not net.has_head:
        raise InvalidArgument("tuning distils next-token distributions: the model needs its head (no --layers)")
    kept: dict[str, nn.Module] = {}
    tunable: dict[str, _Tunable] = {}
    for name, module in quantized.items():
        _, i, attr = name.split(".")
        layer = net.layers[int(i)]
        kept[name] = getattr(layer, attr)
        tunable[name] = _Tunable(module, kept[name])
        setattr(layer, attr, tunable[name])
    fast, net.fast_decode = net.fast_decode, False  # the C++ plan would bypass the modules
    def kl(tokens: list[int]) -> torch.Tensor:
        for t in tunable.values():
            t.teacher = True
        with torch.no_grad():
            target = _log_probs(net, tokens)
        for t in tunable.values():
            t.teacher = False
        return F.kl_div(_log_probs(net, tokens), target, log_target=True, reduction="batchmean")

    try:
        opt = torch.optim.Adam([p for t in tunable.values() for p in (t.a, t.b)], lr=lr)
        with torch.inference_mode(False), torch.enable_grad():
            with torch.no_grad():
                before = kl(held).item()
            for step in range(steps):
                loss = kl(train[step % len(train)])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if report is not None:
                    report(step, loss.item())
            with torch.no_grad():
                after = kl(held).item()
        tuned = {name: t.result() for name, t in tunable.items()}
    finally:
        net.fast_decode = fast
        for name, module in kept.items():
            _, i, attr = name.split(".")
            setattr(net.layers[int(i)], attr, module)
    info = {"steps": steps, "lr": lr, "tokens": sum(len(s) for s in train[:steps]), "kl_before": round(before, 5),
            "kl_after": round(after, 5)}
    return tuned, info
