"""Decode steps replayed from CUDA graphs: one graph per bucketed batch size, its inputs in static buffers.

On a GPU a small model's decode step is bound by kernel launches, not by the chip: a captured
graph replays every launch of the step at once. A graph replays the same kernels on the same addresses
with the same launch sizes, so
- what a step reads lives in buffers made once (tokens, positions, slot_mapping, block_table, seq_lens),
  and a step only copies its values in (one host-to-device copy for the rows, one for the tables);
- the host facts that size launches are fixed per bucket: rows = the bucket, one query per sequence,
  the longest context = the engine's (so the number of key splits is fixed; each program reads only
  its own sequence's keys, from seq_lens on the device);
- a batch is padded to the next bucket with rows that write no KV (slot -1) and read none (seq_len 0);
  their logits are dropped.
Only decode steps of the default mode on the Triton kernels qualify: prompt chunks vary in shape, LoRA
steps take the torch path, and deterministic mode runs its steps eagerly (whether a captured cuBLAS call keeps
an eager one's bits is unmeasured). On a CPU (tests, TRITON_INTERPRET=1) the same static step
runs eagerly (`capture=False`): the buffers, padding and launch sizes are those a GPU would replay.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from superslm.cache.kv import KVCache
from superslm.engine.request import Sequence
from superslm.engine.runner import StepWork
from superslm.errors import InvalidArgument
from superslm.kernels import dispatch
from superslm.kernels.attention import AttnMetadata
from superslm.models.transformer import Transformer

#: batch sizes with a graph of their own (vLLM's spacing): a batch runs in the smallest that holds it
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
#: columns of the per-step row inputs: token, position, slot, seq_len
_ROW_COLUMNS = 4


def bucket_for(batch: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket >= batch, or None when the batch is larger than every bucket."""
    return next((b for b in buckets if b >= batch), None)


def graph_reason(net: Transformer, deterministic: bool) -> str | None:
    """Why decode steps of this model cannot run from static buffers, or None where they can."""
    if deterministic:
        return "deterministic mode runs its batch-invariant steps eagerly"
    if not net.plain:
        return "layers of other parts (gated attention, delta rule, experts) run eagerly on the reference path"
    if dispatch.backend(net.device) != "triton":
        return f"the kernels on {net.device.type} are the torch references (SUPERSLM_KERNELS, triton)"
    if not net.has_head:
        return "a hidden-state model (no head) has no logits to sample"
    if any(r is not None and r.kind == "dynamic" for r in (net.arch.rope, net.arch.rope_local)):
        return "dynamic NTK rope computes each row's frequencies on the host"
    if net.embed_rows is not None:
        return "embedding rows decoded from GGUF blocks on the host"
    if any(t.device.type != net.device.type for t in (*net.parameters(), *net.buffers())):
        return f"some weights are not on {net.device.type} (GGUF blocks run on the CPU)"
    return None


@dataclass
class _Bucket:
    """One bucket's static metadata and (on a GPU) its captured graph, None where it runs eagerly."""

    meta: AttnMetadata
    graph: torch.cuda.CUDAGraph | None


class DecodeGraphs:
    """Static decode steps for up to `max_batch` sequences of up to `context` tokens each.

    `run(chunks)` takes the scheduler's all-decode chunks (one token each, no adapter) and returns the
    finished StepWork and the logits float32 [B, vocab]: views of static outputs, valid until the next run.
    `capture` (default: on a CUDA device) records each bucket's graph at its first use, after one
    eager run that compiles the kernels for its shapes.
    """

    def __init__(
        self, net: Transformer, kv: KVCache, max_batch: int, context: int, capture: bool | None = None,
        deterministic: bool = False,
    ) -> None:  # fmt: skip
        why = graph_reason(net, deterministic)
        if why is not None:
            raise InvalidArgument(f"decode graphs cannot run here: {why}")
        top = bucket_for(max_batch)
        if top is None:
            raise InvalidArgument(f"decode graphs hold at most {BUCKETS[-1]} sequences, not {max_batch}")
        self.net, self.kv = net, kv
        self.buckets = tuple(b for b in BUCKETS if b <= top)
        dev = net.device
        self.capture = dev.type == "cuda" if capture is None else bool(capture)
        if self.capture and dev.type != "cuda":
            raise InvalidArgument(f"CUDA graphs need a CUDA device, the model is on {dev}")
        self.page_size = kv.page_size
        self.max_pages = -(-context // kv.page_size)
        # rows of a step: [token, position, slot, seq_len] per row, copied in at once, then split on the device
        self.rows_in = torch.zeros(top, _ROW_COLUMNS, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(top, self.max_pages, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(top + 1, dtype=torch.int32, device=dev)  # one query per sequence
        # every bucket's graph writes its outputs here (one [top, vocab] buffer, not one per bucket)
        self.hidden = torch.zeros(top, net.arch.dim, dtype=net.dtype, device=dev)
        self.logits = torch.zeros(top, net.arch.vocab, dtype=torch.float32, device=dev)
        # two host copies of the inputs, used in turn: a step's copy in may still be queued behind the step
        # before it (engine/overlap.py launches step N+1 before it waits for step N), so the host fills the
        # other; pinned on a GPU, so the copies neither wait for the queue nor hold the host
        pin = dev.type == "cuda"
        self._host_rows = [torch.zeros(top, _ROW_COLUMNS, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._host_tables = [torch.zeros(top * self.max_pages, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        #: why the last failed capture failed (that bucket's steps then run eagerly on the static buffers)
        self.capture_error: str | None = None
        self._made: dict[int, _Bucket] = {}

    def usable(self, chunks: list[tuple[Sequence, int]]) -> bool:
        """Whether this step is all decode (one new token per sequence, the sequence's last) without
        adapters, and fits the buckets and the tables."""
        if not chunks or len(chunks) > self.buckets[-1]:
            return False
        if dispatch.backend(self.net.device) != "triton":
            return False  # SUPERSLM_KERNELS changed since: the torch path reads the real host metadata
        for seq, n in chunks:
            if n != 1 or seq.num_computed_tokens != len(seq.tokens) - 1 or seq.request.adapter is not None:
                return False
            if len(seq.block_table) > self.max_pages:
                return False
        return True

    def run(self, chunks: list[tuple[Sequence, int]],
            ahead: torch.Tensor | None = None) -> tuple[StepWork, torch.Tensor]:
        """The finished step (hidden states `h` [B, dim]) and its logits float32 [B, vocab], B = len(chunks):
        views of static outputs, valid until the next run. `usable(chunks)` must hold.

        `ahead`: int64 [B] on the device, the tokens of a step still in flight for these sequences, which the
        host has not accepted yet: this step computes the token after each (position num_computed + 1)
        from them, copied on the device. The caller has grown each sequence's pages for it, and `usable(chunks)`
        holds (the step in flight is not accepted yet, so each sequence's newest token is still uncomputed).
        """
        n = len(chunks)
        b = bucket_for(n, self.buckets)
        assert b is not None  # the caller checked `usable(chunks)`
        rows_t = self._host_rows[self._turn][:b]
        rows = rows_t.numpy()
        rows[n:] = (0, 0, -1, 0)  # padding: no KV written, no key read
        shift = 0 if ahead is None else 1
        ps = self.page_size
        # column by column from lists: a numpy row assignment per sequence cost ~2 us (0.6 ms at 256)
        seqs = [seq for seq, _ in chunks]
        pos = [seq.num_computed_tokens + shift for seq in seqs]
        rows[:n, 1] = pos
        rows[:n, 2] = [seq.block_table[p // ps] * ps + p % ps for seq, p in zip(seqs, pos)]
        rows[:n, 3] = rows[:n, 1] + 1
        # ahead: the device's tokens, copied in below
        rows[:n, 0] = 0 if ahead is not None else [seq.tokens[p] for seq, p in zip(seqs, pos)]
        # the tables as one dense [b, width] block of the host buffer: a strided source would be copied to
        # pageable memory first; entries past a sequence's own pages are never read (seq_lens bounds keys)
        width = max(len(seq.block_table) for seq in seqs)
        tables_t = self._host_tables[self._turn][: b * width].view(b, width)
        tables = tables_t.numpy()
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        self._turn ^= 1
        bucket = self._made.get(b) or self._make(b)
        self.block_table[:b, :width].copy_(tables_t, non_blocking=True)
        self.rows_in[:b].copy_(rows_t, non_blocking=True)
        if ahead is not None:
            self.rows_in[:n, 0].copy_(ahead)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            self._forward(b, bucket.meta)
        layers = len(self.net.layers)
        for seq, _ in chunks:
            seq.layers_run += layers
        work = StepWork(chunks, self.tokens[:n], bucket.meta, list(range(n)), self.hidden[:n], layers)
        return work, self.logits[:n]

    def make_all(self) -> float:
        """Build (on a GPU: capture) every bucket's step now rather than at its first use, as servers do at
        start-up so no request waits for a capture; returns the seconds it took."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in reversed(self.buckets):  # largest first: the smaller graphs reuse its pool's memory
                if b not in self._made:
                    self._make(b)
        if self.capture:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    # --- building a bucket ------------------------------------------------------------------------

    def _meta(self, b: int) -> AttnMetadata:
        """Bucket b's metadata over the static buffers, with its PagedArgs preset (no per-step build)."""
        from superslm.kernels.triton.paged_args import PagedArgs, preset_paged_args  # needs triton

        meta = AttnMetadata(
            positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b],
            query_start=tuple(range(b + 1)),
            seq_lens=(self.max_pages * self.page_size,) * b,  # the host's bound; the device has the lengths
            block_tables=(tuple(range(self.max_pages)),) * b,
            page_size=self.page_size,
        )
        args = PagedArgs(
            block_table=self.block_table[:b],
            query_start=self.query_start[: b + 1],
            seq_lens=self.seq_lens[:b],
            positions=self.positions[:b],
            page_size=self.page_size,
            num_rows=b,
            max_query_len=1,
            max_seq_len=self.max_pages * self.page_size,  # fixes the key splits for every replay
            host_query_start=meta.query_start,
        )
        preset_paged_args(meta, args)
        return meta

    def _forward(self, b: int, meta: AttnMetadata) -> None:
        """The step on the static buffers: split the row inputs, embed, every layer, the head; the outputs
        land in the shared `hidden` and `logits` rows 0..b-1."""
        rows = self.rows_in[:b]
        self.tokens[:b].copy_(rows[:, 0])
        self.positions[:b].copy_(rows[:, 1])
        self.slot_mapping[:b].copy_(rows[:, 2])
        self.seq_lens[:b].copy_(rows[:, 3])
        net = self.net
        h = net.run_layers(net.embed(self.tokens[:b]), meta, self.kv.k, self.kv.v)
        self.hidden[:b].copy_(h)
        self.logits[:b].copy_(net.logits(h))

    def _make(self, b: int) -> _Bucket:
        meta = self._meta(b)
        with torch.inference_mode():
            self.rows_in[:b].copy_(torch.tensor((0, 0, -1, 0), device=self.rows_in.device))
            # one eager run on padding rows: compiles the kernels for these shapes, builds the cached tables
            self._forward(b, meta)
        graph = None
        if self.capture:
            try:
                graph = self._capture(lambda: self._forward(b, meta))
            except RuntimeError as e:
                # a kernel that cannot be captured: this bucket's steps still run, eagerly, and say why
                self.capture_error = f"bucket {b}: {type(e).__name__}: {str(e).strip()[:300]}"
                warnings.warn(f"decode graphs run eagerly: capture failed ({self.capture_error})", stacklevel=2)
        made = self._made[b] = _Bucket(meta, graph)
        return made

    def _capture(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            fn()  # warm-up on a side stream, as torch.cuda.graphs recommends
        torch.cuda.current_stream().wait_stream(side)
        # thread_local: another thread's CUDA calls (the server's encoder worker) neither break the capture
        # nor fail themselves
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            fn()
        return graph
