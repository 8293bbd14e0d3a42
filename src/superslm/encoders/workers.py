"""One step's sequences split across single-threaded workers on the CPU (data parallelism).

With T torch threads, a step is cut into T to 2T shards of whole sequences, each run start to end
(pack, layers, pooling) by one of T worker threads holding one intra-op thread; the caller waits. The same T
cores work, but no operator is split across threads, so there is no OpenMP barrier per operator: on a
machine shared with other processes, a descheduled thread no longer stalls its partner (and the
partner's spin-wait no longer burns the CPU the other needs) at every matmul, attention and LayerNorm.
Per sequence the numbers are those of a single-threaded run (docs/encoders.md, speed).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

#: False: run each step in the calling thread with torch's intra-op threads (the benchmark's ablation)
USE_WORKERS = True

#: a shard gets at least this many rows (tokens): smaller matmuls lose more than a split gains
MIN_ROWS = 128

#: shards per thread at most: more than one lets a thread that ran ahead take work a descheduled one left
SHARDS_PER_THREAD = 2

_lock = threading.Lock()
# one pool per size, kept: a caller may still hold a pool of the size it read when another changes it
_pools: dict[int, ThreadPoolExecutor] = {}


def _after_fork() -> None:
    # a forked child has none of the parent's threads: its pools would take tasks and never run them
    global _lock
    _lock = threading.Lock()
    _pools.clear()


os.register_at_fork(after_in_child=_after_fork)


def _start(size: int) -> ThreadPoolExecutor:
    """A pool of `size` threads, each set to one intra-op thread before its first task."""
    caller = torch.get_num_threads()
    ready = threading.Barrier(size)
    pool = ThreadPoolExecutor(size, thread_name_prefix="superslm-encoder")

    def init() -> None:
        torch.set_num_threads(1)
        ready.wait()  # every task blocks until all have started, so the executor makes `size` threads

    for f in [pool.submit(init) for _ in range(size)]:
        f.result()
    # torch.set_num_threads also sets the process default that new threads start from: put it back
    torch.set_num_threads(caller)
    return pool


def workers(size: int) -> ThreadPoolExecutor:
    """The shared pool of `size` threads (started on first use)."""
    with _lock:
        if size not in _pools:
            _pools[size] = _start(size)
        return _pools[size]


def shards(lengths: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous (start, end) ranges of `lengths` (one step's sequences, longest first) of about equal
    cost, at most `parts` of them; sequences of one length mostly stay in one shard (one attention call)."""
    # rows through the linear layers, plus attention's length-squared share (rough, it only balances)
    cost = [n * (1.0 + n / 512.0) for n in lengths]
    total = sum(cost)
    out, start, acc = [], 0, 0.0
    for i, c in enumerate(cost):
        acc += c
        if len(out) < parts - 1 and acc >= total * (len(out) + 1) / parts and i + 1 < len(cost):
            out.append((start, i + 1))
            start = i + 1
    out.append((start, len(cost)))
    return out


def run_split(
    fn: Callable[[list[int]], tuple[list[int], torch.Tensor]],
    indices: Sequence[int],
    lengths: Sequence[int],
    device: torch.device,
) -> tuple[list[int], torch.Tensor]:
    """fn(indices) -> (order, rows), computed over shards of `indices` in parallel on the CPU and joined.

    `indices` must be longest first (as batching.plan gives them); `lengths` are their lengths, in order.
    Runs fn in the calling thread (operators on torch's intra-op threads) when one thread is set, on other
    devices, or when the step has less than one sequence and MIN_ROWS rows per thread."""
    threads = torch.get_num_threads()
    # a multiple of the threads, so no thread is left with a second shard while the others wait
    parts = min(len(indices), sum(lengths) // MIN_ROWS, threads * SHARDS_PER_THREAD) // threads * threads
    # a step too small to give every thread a shard runs as before, its operators split across the threads
    if not USE_WORKERS or device.type != "cpu" or threads < 2 or parts < threads:
        return fn(list(indices))
    pool = workers(threads)

    def task(part: list[int]) -> tuple[list[int], torch.Tensor]:
        with torch.inference_mode():  # a thread-local mode: the caller's does not reach the workers
            return fn(part)

    ranges = shards(lengths, parts)
    done = [f.result() for f in [pool.submit(task, list(indices[a:b])) for a, b in ranges]]
    return [i for order, _ in done for i in order], torch.cat([x for _, x in done])
