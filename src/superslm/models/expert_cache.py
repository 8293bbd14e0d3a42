"""An expert cache: a mixture of experts whose experts do not all fit in the device's memory keeps `slots` of them
on the device and reads the others from host memory when the router picks them, least recently used out first.

Each expert's tensors are kept in host memory as the device holds them (a format's device layout: int4 packs its
nibbles differently on a GPU), pinned where CUDA runs so a read is one asynchronous copy per tensor on the current
stream, ordered after the kernels that still read the slot's previous expert. A slot is an ordinary expert module
on the device whose tensors are overwritten in place, so every weight format runs in it unchanged.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from superslm.errors import InvalidArgument


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's parameters and buffers by name (each tensor once)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


class ExpertCache:
    """`slots` device copies of one block's experts; `get(e)` gives expert e's module on the device, reading it from
    host memory into the least recently used slot when it is not there. Counts hits, misses and the reads' ms."""

    def __init__(self, experts: Sequence[nn.Module], slots: int, device: torch.device | str) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise InvalidArgument(f"expert slots must be a positive integer, got {slots!r}")
        if not experts:
            raise InvalidArgument("an expert cache needs experts")
        device = torch.device(device)
        pin = device.type == "cuda"
        self.count = len(experts)
        #: per expert: its tensors in the device's layout, in host memory
        self.host: list[dict[str, torch.Tensor]] = []
        self.slots: list[nn.Module] = []
        names: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
        for e, module in enumerate(experts):
            on_device = module.to(device)  # one expert at a time: .to() lays the format out as the device runs it
            state = {n: t.detach().to("cpu", copy=True) for n, t in _tensors(on_device)}
            if pin:
                state = {n: t.pin_memory() for n, t in state.items()}
            shape = [(n, tuple(t.shape), t.dtype) for n, t in state.items()]
            if names is None:
                names = shape
            elif shape != names:
                raise InvalidArgument(f"expert {e}'s tensors differ from expert 0's: an expert cache needs one layout")
            self.host.append(state)
            if e < slots:
                self.slots.append(on_device)  # the first experts start in the slots
            else:
                on_device.to("cpu")  # its device memory goes back (the host copy above is what the cache reads)
        #: expert -> slot, least recently used first
        self.where: OrderedDict[int, int] = OrderedDict((e, e) for e in range(len(self.slots)))
        self.hits = self.misses = 0
        self._read_s = 0.0
        self._events: list[tuple[Any, Any]] = []  # CUDA reads not yet timed: (start, end) events

    def get(self, expert: int) -> nn.Module:
        """Expert `expert`'s module on the device (read in if it is not in a slot)."""
        if not 0 <= expert < self.count:
            raise IndexError(f"expert {expert} of {self.count}")
        slot = self.where.get(expert)
        if slot is not None:
            self.hits += 1
            self.where.move_to_end(expert)
            return self.slots[slot]
        self.misses += 1
        if len(self.where) < len(self.slots):
            slot = len(self.where)
        else:
            _, slot = self.where.popitem(last=False)
        self._read(expert, self.slots[slot])
        self.where[expert] = slot
        return self.slots[slot]

    def _read(self, expert: int, module: nn.Module) -> None:
        """Copy expert's host tensors into `module`'s (in place: the module's tensors stay the format's)."""
        src = self.host[expert]
        dst = dict(_tensors(module))
        cuda = next(iter(dst.values())).device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, t in dst.items():
                t.copy_(src[name], non_blocking=cuda)
        if cuda:
            end.record()
            self._events.append((start, end))
        else:
            self._read_s += time.perf_counter() - t0

    @property
    def read_ms(self) -> float:
        """The ms the reads took (on a GPU: the copies' own time between events around them, counted once they
        are done; reading it never waits for the device)."""
        while self._events and self._events[0][1].query():
            start, end = self._events.pop(0)
            self._read_s += start.elapsed_time(end) / 1000
        return self._read_s * 1000

    def stats(self) -> dict[str, Any]:
        """{"slots", "hits", "misses", "read_ms"}."""
        return {"slots": len(self.slots), "hits": self.hits, "misses": self.misses, "read_ms": self.read_ms}


class CachedExperts(Sequence[tuple[nn.Module, nn.Module]]):
    """A block's experts as (gate_up, down) pairs by index, each read into its cache's slot when indexed: what
    kernels/moe_step.py's reference takes as MoEParts.experts (it runs one expert at a time)."""

    def __init__(self, cache: ExpertCache) -> None:
        self.cache = cache

    def __len__(self) -> int:
        return self.cache.count

    def __getitem__(self, expert: int) -> tuple[nn.Module, nn.Module]:  # type: ignore[override]
        if not isinstance(expert, int):
            raise TypeError("experts are read one index at a time")
        m = self.cache.get(expert)
        return m.gate_up, m.down  # type: ignore[return-value]
