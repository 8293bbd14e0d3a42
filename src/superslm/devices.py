"""Which device and dtype a model runs in: the bottom of the house, so formats, encoders and models all ask here."""

from __future__ import annotations

import os

import torch

from superslm.errors import InvalidArgument

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def pick_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgument(f"unknown device {device!r}") from e
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index is not None and dev.index >= count):
            raise InvalidArgument(f"device {str(dev)!r}: this machine has {count} CUDA device(s)")
    elif dev.type != "cpu":
        raise InvalidArgument(f"device {str(dev)!r}: models run on cpu or cuda (ROCm devices are cuda too)")
    return dev


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidArgument(f"unknown dtype {dtype!r} (known: {sorted(DTYPES)})")
    return DTYPES[dtype]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share, not the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


_WANTED: int | None = None


def set_threads(n: int | None = None) -> int:
    """Threads for the CPU kernels (torch's and ours, which share its pool): `n`, or by default the cores this
    process may use. Returns the number set. Engines use at most this many, fewer while other processes keep
    cores busy (`ThreadPolicy`)."""
    global _WANTED
    if n is None:
        n = usable_cores()
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgument(f"threads must be a positive integer, got {n!r}")
    torch.set_num_threads(n)
    _WANTED = n
    return n


def wanted_threads() -> int:
    """The threads `set_threads` asked for (before it was called: torch's current count)."""
    return _WANTED if _WANTED is not None else torch.get_num_threads()


def others_running() -> int | None:
    """Tasks of other processes running or waiting for a CPU right now (Linux: /proc/stat's procs_running less
    this process's own running threads); None where /proc cannot say."""
    try:
        with open("/proc/stat", "rb") as f:
            total = next(int(line.split()[1]) for line in f if line.startswith(b"procs_running"))
        own = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # the thread ended meanwhile
                continue
            end = stat.rindex(b")")  # the state follows the command name, which may hold spaces
            own += stat[end + 2 : end + 3] == b"R"
    except (OSError, StopIteration, ValueError):
        return None
    return max(0, total - own)


class ThreadPolicy:
    """How many threads a CPU step uses: the wanted count (`set_threads`), fewer while other processes keep cores
    busy. Two OpenMP threads on two cores, one of them taken by another process, wait on each other at every
    barrier: SmolLM2 decoded at 35 tok/s on 2 threads where 1 thread gave 91. The results do not depend on the
    count (every kernel splits rows, never a row's sums), so switching changes speed only. Looks at most every
    `every_s` seconds (a look costs ~50 us); the middle of the last three looks decides (one blip does not)."""

    def __init__(self, every_s: float = 0.05, probe: object = None, clock: object = None) -> None:
        import time

        self.every_s = every_s
        self._probe = probe or others_running
        self._clock = clock or time.monotonic
        self._looks: list[int] = []
        self._last = float("-inf")
        self.threads = torch.get_num_threads()

    def choose(self) -> int:
        """The threads for the next step (set in torch, which our kernels follow)."""
        wanted = wanted_threads()
        now = self._clock()  # type: ignore[operator]
        if now - self._last >= self.every_s:
            self._last = now
            busy = self._probe()  # type: ignore[operator]
            self._looks = [*self._looks[-2:], 0 if busy is None else busy]
        busy = sorted(self._looks)[len(self._looks) // 2] if self._looks else 0
        n = max(1, min(wanted, usable_cores() - busy))
        if n != self.threads or n != torch.get_num_threads():
            torch.set_num_threads(n)
            self.threads = n
        return n
