"""The Engine: many sequences at once on a paged KV cache, a step at a time.

    engine = model.engine(slots=8, context=2048)
    rid = engine.add(Request(prompt="Once upon", max_tokens=32, sampling=Sampling(temperature=0.7)))
    while engine.busy():
        for p in engine.advance():
            print(p.id, p.text, p.end)
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from superslm.cache import PagePool
from superslm.cache.kv import KVCache, KVFormat, choose_format, kv_format
from superslm.cache.state import Checkpoints, RecurrentStates
from superslm.engine.contracts import ContractsMixin, Prefix
from superslm.engine.manual import ManualSlots
from superslm.engine.mtp_drafter import MTPSpeculator, mtp_config, scratch_pages
from superslm.engine.output import OutputProcessor
from superslm.engine.overlap import GraphSteps
from superslm.engine.request import END_CANCELLED, END_LENGTH, Progress, Request, Sequence
from superslm.engine.runner import ModelRunner
from superslm.engine.scheduler import AsyncScheduler, Scheduler
from superslm.engine.sequences import SequenceMixin
from superslm.engine.speculative import Speculative, Speculator
from superslm.errors import (
    ContextLengthExceeded,
    InvalidArgument,
)
from superslm.memory import available_memory
from superslm.sampling import Sampling, TokenLogprobs

if TYPE_CHECKING:
    from superslm.engine.graphs import DecodeGraphs
    from superslm.model import Model


@dataclass
class Completion:
    """A finished request as `Engine.generate` returns it."""

    id: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    cached: int = 0
    end: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_tokens: int = 0
    #: Sampling.prompt_logprobs: per prompt position (None for the first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


#: what the recurrent states' checkpoints may take beyond one a slot
_CHECKPOINT_BYTES = 256 << 20


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return available_memory()


class Engine(SequenceMixin, ContractsMixin):
    """Runs up to `slots` sequences of at most `context` tokens, in steps of at most `rows` rows.

    `kv_budget` sizes the KV pool: bytes (an int), a fraction of the free memory (a float in (0, 1]),
    or None: enough pages for every slot's whole context, capped at half the free memory.
    `page_size` is the tokens per KV page; `prefix_caching` keeps full pages for later prompts (a model with
    delta-rule layers resumes after the longest cached run of pages whose recurrent states it checkpointed: each
    running sequence's states at each page boundary it reaches, the most recent 4 a slot kept, fewer where that
    passes 256 MB, never fewer than one a slot);
    `chunk` caps the prompt tokens one sequence reads per step (default: rows). With rows >= slots
    every generating sequence gets its next token in every step.

    `deterministic=True`: a request's tokens and logprobs are bit-identical whatever else is in the
    batch, however its prompt is chunked, cache hit or miss, preemption, save/restore or layer budget
    (batch-invariant kernels; see kernels/attention_invariant.py). The default mode gives the same
    tokens for the same inputs and batch, and seeded sampling independent of the batch, but float
    rounding may differ between batch compositions (and so, rarely, a greedy token).

    `graphs`: decode steps replay CUDA graphs captured per bucketed batch size (engine/graphs.py); on by
    default on a CUDA device with the Triton kernels, outside deterministic mode; False turns them off.
    `overlap`: with graphs, launch the next decode step before the host accepts this one where nothing it
    learns could change it (engine/overlap.py, decided by an AsyncScheduler); by default where the graphs are
    captured (a CUDA device).
    `adaptive_threads` (CPU): each step uses the threads `superslm.set_threads` asked for, fewer while other
    processes keep cores busy (devices.ThreadPolicy; results do not change with the count); default on, off with
    False or SUPERSLM_ADAPTIVE_THREADS=0.
    `speculative`: "ngram" (or a `Speculative`) drafts each decoding sequence's next tokens by prompt lookup and
    verifies them in one step (engine/speculative.py): the same tokens and logprobs as without drafts (bit-identical
    in deterministic mode), fewer steps where the answer repeats its context; `stats()` counts the drafts. It
    launches no step ahead (overlap: the next step's drafts come from this step's tokens). A model with delta-rule
    layers steps a drafting sequence's rows one at a time, keeps the recurrent states after each in scratch rows
    and, once verified, resumes from the state after the last kept row. "mtp" drafts with the model's own
    multi-token prediction block (Qwen3.5 / Qwen3-Next checkpoints that keep it; UnsupportedModel otherwise): up to
    3 tokens a step, the KV cache one attention layer longer for it (engine/mtp_drafter.py); a mapping names a
    Speculative's fields ({"method": "mtp", "num_speculative_tokens": 2}, as vLLM's speculative config).
    `kv`: the KV page format (cache/kv.py kv_format): "bf16", "fp16", "fp32", "int8" (codes and a scale per token
    and head: about half the bytes, so the same kv_budget holds ~2x the tokens), "k8v4", "k4v8", "k4v4" (4-bit
    rows of each head rotated by a Hadamard transform: about a quarter), or "auto": the model dtype's pages where
    they hold every slot's whole context in the budget (and always with a kv_budget in bytes), else the most
    precise quantized format that does and whose measured perplexity loss for the model's size is within +3%
    (cache/kv.py choose_format).
    """

    def __init__(
        self,
        model: Model,
        slots: int = 8,
        context: int | None = None,
        rows: int = 512,
        kv_budget: int | float | None = None,
        page_size: int = 16,
        prefix_caching: bool = True,
        chunk: int | None = None,
        deterministic: bool = False,
        jump_forward: bool = True,
        graphs: bool | None = None,
        overlap: bool | None = None,
        adaptive_threads: bool | None = None,
        speculative: str | dict[str, Any] | Speculative | None = None,
        kv: str = "auto",
    ) -> None:
        a = model.arch
        context = min(a.context, 4096) if context is None else context
        if not isinstance(slots, int) or slots < 1:
            raise InvalidArgument(f"slots must be a positive integer, got {slots!r}")
        if not isinstance(context, int) or context < 2:
            raise InvalidArgument(f"context must be an integer >= 2, got {context!r}")
        if not isinstance(rows, int) or rows < 1:
            raise InvalidArgument(f"rows must be a positive integer, got {rows!r}")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise InvalidArgument(f"chunk must be a positive integer, got {chunk!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise InvalidArgument(f"page_size must be a positive integer, got {page_size!r}")
        self.model, self.net = model, model.net
        self.slots, self.context, self.rows, self.page_size = slots, context, rows, page_size
        device, dtype = model.device, model.dtype
        layers = self.net.kv_layers  # delta-rule layers keep a recurrent state per slot instead of KV pages
        spec = Speculative.of(speculative)
        if spec is not None:  # unpriced: the curve of the kernels this engine's multi-row steps run on
            spec = spec.for_device(model.device, bool(deterministic))
        mtp = spec is not None and spec.method == "mtp"
        if mtp:
            spec = mtp_config(self.net, spec, graphs)
            graphs = False  # they keep no hidden states
            layers += a.mtp  # the MTP's attention layers: their KV in the same pages as the body's
        self.states = self._recurrent_states(slots, dtype, device, spec)
        want = slots * -(-context // page_size)
        if kv_budget is None:
            budget = _available_memory(device) // 2
        elif isinstance(kv_budget, float):
            if not 0 < kv_budget <= 1:
                raise InvalidArgument(f"a fractional kv_budget must be in (0, 1], got {kv_budget}")
            budget = int(_available_memory(device) * kv_budget)
        elif isinstance(kv_budget, int) and not isinstance(kv_budget, bool) and kv_budget > 0:
            budget = kv_budget
        else:
            raise InvalidArgument(f"kv_budget must be bytes, a fraction or None, got {kv_budget!r}")

        def page_bytes_of(fmt: str | KVFormat) -> int:
            return KVCache.page_bytes(max(layers, 1), page_size, a.kv_heads, a.head_dim, dtype, fmt)

        fmt = kv_format(kv)
        if fmt.auto and not isinstance(kv_budget, int):
            # quantized pages only where the model dtype's would not hold every slot's whole context in the
            # budget taken from the machine; a budget in bytes was sized in the model dtype's pages (float pages)
            fmt = choose_format(model.source.parameter_count(), a.head_dim, device,
                                lambda f: budget // page_bytes_of(f) >= want)
        page_bytes = page_bytes_of(fmt)
        pages = budget // page_bytes if kv_budget is not None else min(want, budget // page_bytes)
        if pages < 1:
            raise InvalidArgument(f"kv_budget holds no KV page ({page_bytes} bytes each)")
        # pages past the pool's: the MTP's chained drafts write their KV rows there (mtp_drafter.py)
        extra = scratch_pages(spec, slots, page_size) if mtp else 0
        self.kv = KVCache(layers, pages + extra, page_size, a.kv_heads, a.head_dim, dtype, device, fmt)
        self.pool = PagePool(pages, page_size)
        self.deterministic = bool(deterministic)
        self._graphs = self._decode_graphs(graphs)
        if overlap and self._graphs is None:
            raise InvalidArgument("overlap=True launches decode steps ahead from the decode graphs, which are off")
        if spec is not None and overlap:
            raise InvalidArgument("overlap=True launches the next decode step before this one's tokens are known, "
                                  "and so before its drafts exist: speculative decoding runs without it")
        if spec is not None:
            overlap = False
        self.overlap = bool(self._graphs is not None and (self._graphs.capture if overlap is None else overlap))
        # the one owner of pages and of what runs next; launching steps ahead is its variant's decision
        kind = AsyncScheduler if self.overlap else Scheduler
        # a delta-rule model resumes a cached prefix only where its states were checkpointed (a page boundary)
        self.checkpoints, self.saved_states = self._state_checkpoints(slots, dtype, device, prefix_caching)
        self.scheduler = kind(self.pool, slots, rows, prefix_caching, chunk=chunk, copy_page=self._copy_page,
                              recurrent=self.states is not None, copy_state=self._copy_state,
                              usable_prefix=self._usable_prefix if self.checkpoints is not None else None,
                              draft_rows=None if self.states is None else self.states.scratch,
                              keep_state=self._keep_state, mtp=mtp)
        self.vocab = a.vocab
        self.speculator = None if spec is None else Speculator(spec)
        self.output = OutputProcessor(self.net, self.scheduler, frozenset(model.stop_ids), a.vocab, bool(jump_forward),
                                      self.speculator)
        steps = None if self._graphs is None else GraphSteps(self._graphs, self.scheduler, self.output)
        if adaptive_threads is None:
            adaptive_threads = os.environ.get("SUPERSLM_ADAPTIVE_THREADS", "1") != "0"
        self.runner = ModelRunner(self.net, self.kv, page_size, self.deterministic, steps, bool(adaptive_threads),
                                  self.states)
        if mtp:
            assert spec is not None
            self.speculator = MTPSpeculator(spec, self.runner, page_size, range(pages, pages + extra))
            self.output.speculator = self.speculator
        self._next_id = 0
        self._rng = random.Random()
        self._manual: ManualSlots | None = None

    def _recurrent_states(self, slots: int, dtype: torch.dtype, device: torch.device,
                          spec: Speculative | None = None) -> RecurrentStates | None:
        """A row of recurrent states per slot for the net's delta-rule layers, and one more (the last) where a
        prefix handle is prefilled; None where the net has no such layers. With drafts, scratch rows for the states
        after a step's draft rows: k a slot, fewer where that passes 256 MB, never fewer than k (a sequence drafting
        alone drafts fully); unwritten until used, so on the CPU they take memory as drafts use them."""
        d = self.net.arch.delta
        if not self.net.state_layers or d is None:
            return None
        scratch = 0
        if spec is not None:
            size = RecurrentStates.slot_bytes(self.net.state_layers, d.conv_width, d.conv, d.v_heads, d.k_dim,
                                              d.v_dim, dtype)
            scratch = max(spec.k, min(spec.k * slots, _CHECKPOINT_BYTES // size))
        return RecurrentStates(self.net.state_layers, slots + 1, d.conv_width, d.conv, d.v_heads, d.k_dim, d.v_dim,
                               dtype, device, scratch=scratch)

    def _state_checkpoints(self, slots: int, dtype: torch.dtype, device: torch.device, prefix_caching: bool
                           ) -> tuple[Checkpoints | None, RecurrentStates | None]:  # fmt: skip
        """The index and rows of the checkpoints of recurrent states at page boundaries, for the prefix cache of a
        delta-rule model (None, None for other models and without a prefix cache): 4 a slot, fewer where that
        passes 256 MB, at least one a slot (Qwen3.5-0.8B's states take 19 MB a row). Rows are written before
        they are read, so they are left unwritten: a row takes memory once a checkpoint fills it."""
        d = self.net.arch.delta
        if self.states is None or d is None or not prefix_caching:
            return None, None
        size = RecurrentStates.slot_bytes(self.net.state_layers, d.conv_width, d.conv, d.v_heads, d.k_dim, d.v_dim,
                                          dtype)
        n = max(slots, min(4 * slots, _CHECKPOINT_BYTES // size))
        rows = RecurrentStates(self.net.state_layers, n, d.conv_width, d.conv, d.v_heads, d.k_dim, d.v_dim, dtype,
                               device, zeroed=False)
        return Checkpoints(n), rows

    def _decode_graphs(self, graphs: bool | None) -> DecodeGraphs | None:
        """Decode steps from static buffers (CUDA graphs on a GPU: engine/graphs.py) where they can run:
        by default on CUDA devices; graphs=True asks for them (an error where they cannot run), False never."""
        if graphs is False or (graphs is None and self.net.device.type != "cuda"):
            return None
        from superslm.engine.graphs import BUCKETS, DecodeGraphs, graph_reason

        why = graph_reason(self.net, self.deterministic)
        if why is not None:
            if graphs:
                raise InvalidArgument(f"graphs=True: decode graphs cannot run here: {why}")
            return None
        return DecodeGraphs(self.net, self.kv, min(self.slots, BUCKETS[-1]), self.context)

    # --- requests ---------------------------------------------------------------------------------

    def _register(self, seq: Sequence) -> None:
        self._next_id += 1
        self.output.seqs[seq.id] = seq

    def add(self, request: Request) -> int:
        """Queue a request; returns its id. Its Progress comes from later `advance` calls."""
        return self._add(request).id

    def _add(self, request: Request) -> Sequence:
        if not isinstance(request, Request):
            raise InvalidArgument("add() takes a Request")
        if not isinstance(request.max_tokens, int) or isinstance(request.max_tokens, bool) or request.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be a positive integer, got {request.max_tokens!r}")
        if not isinstance(request.speculative, bool):
            raise InvalidArgument(f"speculative must be True or False, got {request.speculative!r}")
        prompt = self._prompt_ids(request.prompt)
        if not prompt:
            # with a prefix too: its last token is computed already, so nothing would give the first logits
            raise InvalidArgument("the prompt is empty (after a prefix it needs at least one token of its own)")
        pre = request.prefix
        if pre is not None:
            if not isinstance(pre, Prefix) or pre.released or pre.owner() is not self:
                raise InvalidArgument("prefix must be a live handle from this engine's prefix()")
            if request.sampling is not None and getattr(request.sampling, "prompt_logprobs", None) is not None:
                raise InvalidArgument("prompt_logprobs need the whole prompt computed; a prefix handle's is not")
            if request.adapter is not None:
                raise InvalidArgument("a prefix handle holds the base model's KV; an adapted request cannot adopt it "
                                      "(the automatic prefix cache keeps its pages per adapter)")
            prompt = list(pre.tokens) + prompt
        if len(prompt) >= self.context:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt)} tokens; the context holds {self.context} (prompt and answer)"
            )
        adapter = request.adapter
        if adapter is not None:
            self._check_adapter(adapter)
        seq = self._new_sequence(request, prompt)
        self._register(seq)
        if pre is not None:
            pre.users.add(id(seq))
        if adapter is not None:
            adapter.users.add(id(seq))
        self.output.start(seq)
        if seq.id in self.output.seqs:
            self.scheduler.add(seq)
        return seq

    def cancel(self, request_id: int) -> None:
        """End a request now ("cancelled"); its pages go back to the pool at once."""
        seq = self._live(request_id)
        if self._in_step(seq):
            # mid-step (layer budget): finish the step's other rows first, then drop it
            seq.end = END_CANCELLED
            return
        self.output.finish(seq, END_CANCELLED)

    def busy(self) -> bool:
        """True while any request is queued, running or has Progress not yet returned."""
        return bool(self.output.seqs or self.output.pending or self.runner.busy())

    # --- stepping ---------------------------------------------------------------------------------

    def advance(self, layer_budget: int | None = None) -> list[Progress]:
        """Run one step (or, with a layer budget, at most that many layers of it) and report.

        With a layer budget, a step whose layers are not all done reports nothing for its tokens
        (they are in progress); the next call continues it."""
        if layer_budget is not None and (not isinstance(layer_budget, int) or layer_budget < 1):
            raise InvalidArgument(f"layer_budget must be a positive integer, got {layer_budget!r}")
        out, self.output.pending = self.output.pending, []
        with torch.inference_mode():
            if self.runner.in_flight:
                # the step launched ahead last call: accept it (launching the one after it, unless budgeted)
                self.runner.settle(out, go_on=layer_budget is None)
                return out
            chunks = None  # None: the step stopped between layers goes on
            if self.runner.work is None:
                sched = self.scheduler.schedule()  # schedule
                for seq in sched.too_long:
                    self.output.finish(seq, END_LENGTH, into=out)
                if not sched.chunks:
                    return out
                chunks = sched.chunks
            work = self.runner.run(chunks, layer_budget, out)  # execute (a graph step samples and reports itself)
            if work is None:
                return out
            self.output.prompt_logprobs(work)
            tokens = self.output.greedy_tokens(work)  # sample: greedy rows certified by the head, or all logits
            logits = self.runner.logits(work) if tokens is None else None
        out.extend(self.output.accept(work, logits, tokens))  # update
        self._checkpoint_states(work)
        return out

    @property
    def steps(self) -> int:
        """Steps run to the end so far."""
        return self.runner.steps

    @property
    def jump_forward(self) -> bool:
        """Whether tokens a grammar forces are appended without sampling them (off: each is masked and sampled)."""
        return self.output.jump_forward

    @jump_forward.setter
    def jump_forward(self, on: bool) -> None:
        self.output.jump_forward = bool(on)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """The decode graphs (engine/graphs.py: buckets, `capture`, `capture_error`), None when off."""
        return self._graphs

    def warm_up_graphs(self) -> float:
        """Capture the decode graphs of every batch bucket now (otherwise each at its first use); the seconds
        it took, 0.0 where this engine runs without graphs."""
        return 0.0 if self._graphs is None else self._graphs.make_all()

    # --- low-level use ----------------------------------------------------------------------------

    def _manual_slots(self) -> ManualSlots:
        if self._manual is None:
            states = None if self.states is None else self._recurrent_states(self.slots, self.net.dtype,
                                                                             self.net.device)
            self._manual = ManualSlots(self.net, self.kv, self.scheduler, self.slots, self.context,
                                       self.deterministic, states)
        return self._manual

    def step(self, tokens: list[int], slots: list[int], wanted: list[bool]) -> torch.Tensor:
        """Low level: append each token row to its slot (0..slots-1, caller-owned sequences sharing
        the KV pool with requests) and return the logits of the wanted rows, in row order."""
        with torch.inference_mode():
            # a step in flight is accepted first: its Progress comes with advance
            self.runner.settle(self.output.pending)
        return self._manual_slots().step(tokens, slots, wanted)

    def reset(self, slot: int) -> None:
        """Empty a low-level slot (see `step`) and free its pages."""
        if self._manual is not None:
            self._manual.reset(slot)

    # --- conveniences -----------------------------------------------------------------------------

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """Run requests to the end, together; results in the order given."""
        seqs: list[Sequence] = []
        try:
            for r in requests:
                seqs.append(self._add(r))
        except BaseException:
            for seq in seqs:  # a refused request: the ones before it do not run on without a caller
                if seq.id in self.output.seqs:
                    self.cancel(seq.id)
            added = {seq.id for seq in seqs}
            self.output.pending = [p for p in self.output.pending if p.id not in added]
            raise
        ids = [seq.id for seq in seqs]
        done: dict[int, Completion] = {seq.id: Completion(seq.id) for seq in seqs}
        for seq in seqs:
            done[seq.id].prompt_tokens = len(seq.prompt)
        others: list[Progress] = []  # requests added with add(): their reports wait for the next advance()
        try:
            self._generate_loop(done, others)
        finally:
            self.output.pending.extend(others)
        return [done[i] for i in ids]

    def _generate_loop(self, done: dict[int, Completion], others: list[Progress]) -> None:
        while any(not c.end for c in done.values()):
            for p in self.advance():
                c = done.get(p.id)
                if c is None:
                    others.append(p)
                    continue
                c.tokens += p.tokens
                c.text += p.text
                c.logprobs += p.logprobs
                if p.prompt_logprobs is not None:
                    c.prompt_logprobs = p.prompt_logprobs
                c.cached = p.cached
                if p.end:
                    c.end = p.end

    def complete(self, prompt: str | list[int], limit: int = 256, sampling: Sampling | None = None) -> str:
        """The text of one request run to the end."""
        req = Request(prompt=prompt, max_tokens=limit, sampling=sampling or Sampling())
        return self.generate([req])[0].text
