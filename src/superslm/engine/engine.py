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
from typing import TYPE_CHECKING

import torch

from superslm.cache import PagePool
from superslm.cache.kv import KVCache
from superslm.engine.manual import ManualSlots
from superslm.engine.request import END_CANCELLED, END_LENGTH, END_STOP, Progress, Request, Sequence
from superslm.engine.runner import StepWork, build_step, run_layers, step_logits
from superslm.engine.scheduler import Scheduler
from superslm.engine import persist
from superslm.errors import (
    ContextLengthExceeded,
    InvalidArgument,
    KVCacheFull,
    SequenceBusy,
    StateCorrupted,
    TokenOutOfRange,
    UnknownRequest,
)
from superslm.sampling import SamplerState, Sampling, StopChecker, TokenLogprobs, sample

if TYPE_CHECKING:
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


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class Engine:
    """Runs up to `slots` sequences of at most `context` tokens, in steps of at most `rows` rows.

    `kv_budget` sizes the KV pool: bytes (an int), a fraction of the free memory (a float in (0, 1]),
    or None: enough pages for every slot's whole context, capped at half the free memory.
    `page_size` is the tokens per KV page; `prefix_caching` keeps full pages for later prompts;
    `chunk` caps the prompt tokens one sequence reads per step (default: rows). With rows >= slots
    every generating sequence gets its next token in every step.

    `deterministic=True`: a request's tokens and logprobs are bit-identical whatever else is in the
    batch, however its prompt is chunked, cache hit or miss, preemption, save/restore or layer budget
    (batch-invariant kernels; see kernels/attention_invariant.py). The default mode gives the same
    tokens for the same inputs and batch, and seeded sampling independent of the batch, but float
    rounding may differ between batch compositions (and so, rarely, a greedy token).
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
        layers = len(self.net.layers)
        page_bytes = KVCache.page_bytes(layers, page_size, a.kv_heads, a.head_dim, dtype)
        want = slots * -(-context // page_size)
        if kv_budget is None:
            pages = min(want, _available_memory(device) // 2 // page_bytes)
        elif isinstance(kv_budget, float):
            if not 0 < kv_budget <= 1:
                raise InvalidArgument(f"a fractional kv_budget must be in (0, 1], got {kv_budget}")
            pages = int(_available_memory(device) * kv_budget) // page_bytes
        elif isinstance(kv_budget, int) and kv_budget > 0:
            pages = kv_budget // page_bytes
        else:
            raise InvalidArgument(f"kv_budget must be bytes, a fraction or None, got {kv_budget!r}")
        if pages < 1:
            raise InvalidArgument(f"kv_budget holds no KV page ({page_bytes} bytes each)")
        self.kv = KVCache(layers, pages, page_size, a.kv_heads, a.head_dim, dtype, device)
        self.pool = PagePool(pages, page_size)
        self.scheduler = Scheduler(self.pool, slots, rows, prefix_caching, chunk=chunk)
        self.vocab = a.vocab
        self._stop_ids = frozenset(model.stop_ids)
        self._seqs: dict[int, Sequence] = {}
        self._next_id = 0
        self._pending: list[Progress] = []
        self._work: StepWork | None = None
        self._rng = random.Random()
        self.steps = 0
        self._manual: ManualSlots | None = None
        self.deterministic = bool(deterministic)

    # --- requests ---------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            return self.model.tokenizer.encode(prompt, add_special_tokens=True)
        try:
            ids = [int(t) for t in prompt]  # type: ignore[attr-defined]
        except (TypeError, ValueError) as e:
            raise InvalidArgument("prompt must be text or a sequence of token ids") from e
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise TokenOutOfRange(f"prompt token {bad[0]} is outside the vocabulary [0, {self.vocab})")
        return ids

    def add(self, request: Request) -> int:
        """Queue a request; returns its id. Its Progress comes from later `advance` calls."""
        if not isinstance(request, Request):
            raise InvalidArgument("add() takes a Request")
        sampling = request.sampling if request.sampling is not None else Sampling()
        sampling.validate(self.vocab)
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be a positive integer, got {request.max_tokens!r}")
        prompt = self._prompt_ids(request.prompt)
        if not prompt:
            raise InvalidArgument("the prompt is empty")
        if len(prompt) >= self.context:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt)} tokens; the context holds {self.context} (prompt and answer)"
            )
        from superslm.tokenizer import StreamDecoder

        seq = Sequence(
            self._next_id, request, prompt,
            max_tokens=min(request.max_tokens, self.context - len(prompt)),
            sampler=SamplerState.create(sampling, prompt, rng=self._rng),
            decoder=StreamDecoder(self.model.tokenizer),
            stops=StopChecker(sampling.stop),
        )
        self._next_id += 1
        self._seqs[seq.id] = seq
        self.scheduler.add(seq)
        return seq.id

    def cancel(self, request_id: int) -> None:
        """End a request now ("cancelled"); its pages go back to the pool at once."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise UnknownRequest(f"no live request with id {request_id}")
        if self._work is not None and any(s is seq for s, _ in self._work.chunks):
            # mid-step (layer budget): finish the step's other rows first, then drop it
            seq.end = END_CANCELLED
            return
        self._finish(seq, END_CANCELLED)

    def busy(self) -> bool:
        """True while any request is queued, running or has Progress not yet returned."""
        return bool(self._seqs or self._pending or self._work is not None)

    # --- stepping ---------------------------------------------------------------------------------

    def advance(self, layer_budget: int | None = None) -> list[Progress]:
        """Run one step (or, with a layer budget, at most that many layers of it) and report."""
        if layer_budget is not None and (not isinstance(layer_budget, int) or layer_budget < 1):
            raise InvalidArgument(f"layer_budget must be a positive integer, got {layer_budget!r}")
        out, self._pending = self._pending, []
        if self._work is None:
            sched = self.scheduler.schedule()
            for seq in sched.too_long:
                self._finish(seq, END_LENGTH, into=out)
            if not sched.chunks:
                return out
            self._work = build_step(sched.chunks, self.page_size, self.net.device, self.deterministic)
        with torch.inference_mode():
            done = run_layers(self.net, self.kv, self._work, layer_budget)
            if not done:
                return out
            work, self._work = self._work, None
            logits = step_logits(self.net, work)
        self.steps += 1
        out.extend(self._accept(work, logits))
        return out

    def _accept(self, work: StepWork, logits: torch.Tensor) -> list[Progress]:
        sampling_seqs: list[Sequence] = []
        for (seq, n), row in zip(work.chunks, work.sample_rows):
            seq.num_computed_tokens += n
            if row >= 0:
                sampling_seqs.append(seq)
                if not seq.output and work.h is not None:
                    # the seed's prefill hidden state: final norm at the last prompt position
                    seq.prefill_hidden = self.net.final_norm(work.h[row]).float().clone()
            elif not seq.end:
                self.scheduler.register(seq)
        out: list[Progress] = []
        if sampling_seqs:
            result = sample(logits, [s.sampler for s in sampling_seqs])
            tokens = result.token_list()
            logprobs = result.logprobs()
            for seq, token, lp in zip(sampling_seqs, tokens, logprobs):
                if seq.end == END_CANCELLED:
                    out.append(self._finish(seq, END_CANCELLED))
                    continue
                out.append(self._take(seq, token, lp))
        for seq, _ in work.chunks:
            if seq.end == END_CANCELLED and seq.id in self._seqs:
                out.append(self._finish(seq, END_CANCELLED))
        return out

    def _take(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> Progress:
        """Accept one sampled token: stop checks, text, prefix-cache registration."""
        p = Progress(seq.id, cached=seq.cached)
        seq.sampler.append_token(token)
        params = seq.sampler.params
        if lp is not None:
            p.logprobs.append(lp)
        if token in params.stop_token_ids or (token in self._stop_ids and not params.ignore_eos):
            seq.stop_reason = token
            self._finish(seq, END_STOP, progress=p)
            return p
        seq.output.append(token)
        p.tokens.append(token)
        piece = seq.decoder.push(token)
        res = seq.stops.push(piece)
        p.text += res.text
        if res.stopped:
            seq.stop_reason = res.stop
            self._finish(seq, END_STOP, progress=p)
        elif len(seq.output) >= seq.max_tokens:
            self._finish(seq, END_LENGTH, progress=p)
        else:
            self.scheduler.register(seq)
        return p

    def _finish(self, seq: Sequence, end: str, progress: Progress | None = None,
                into: list[Progress] | None = None) -> Progress:
        """End a sequence: flush its held text, free its pages, and report it."""
        p = progress or Progress(seq.id, cached=seq.cached)
        if end != END_STOP or seq.stop_reason is None or isinstance(seq.stop_reason, int):
            # a stop string ends the text where it starts; anything else releases what was held
            p.text += seq.stops.push(seq.decoder.flush()).text + seq.stops.flush()
        seq.end, p.end, p.stop_reason = end, end, seq.stop_reason
        self.scheduler.remove(seq)
        self._seqs.pop(seq.id, None)
        if progress is None:
            (self._pending if into is None else into).append(p)
        return p

    # --- sequence state -------------------------------------------------------------------------

    def _live(self, request_id: int) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise UnknownRequest(f"no live request with id {request_id}")
        return seq

    def stats(self, request_id: int) -> dict[str, object]:
        """Where a live request stands: tokens, layers run, KV pages resident, cached prompt tokens."""
        seq = self._live(request_id)
        return {
            "prompt_tokens": len(seq.prompt),
            "output_tokens": len(seq.output),
            "num_computed_tokens": seq.num_computed_tokens,
            "layers_run": seq.layers_run,
            "forced_tokens": 0,
            "kv_pages": len(seq.block_table),
            "cached": seq.cached,
            "preemptions": seq.preemptions,
            "grammar_accepting": None,
            "in_step": self._work is not None and any(s is seq for s, _ in self._work.chunks),
        }

    def prefill_hidden(self, request_id: int) -> torch.Tensor | None:
        """The final normed hidden state [dim] of a live request's last prompt position (None until
        its prompt has been read)."""
        return self._live(request_id).prefill_hidden

    def save(self, request_id: int) -> bytes:
        """The whole state of a live request as a versioned blob (see engine/persist.py)."""
        seq = self._live(request_id)
        if self._work is not None and any(s is seq for s, _ in self._work.chunks):
            raise SequenceBusy(f"request {request_id} is mid-step; advance until its step completes")
        n, ps = seq.num_computed_tokens, self.page_size
        slots = torch.tensor([seq.block_table[p // ps] * ps + p % ps for p in range(n)], dtype=torch.long,
                             device=self.kv.k.device)
        header = {"model": self.model.fingerprint, "page_size": ps, "sequence": persist.sequence_state(seq)}
        return persist.encode(header, self.kv.k[:, slots], self.kv.v[:, slots])

    def restore(self, blob: bytes) -> int:
        """A new live request continuing a saved one exactly; returns its id. With no room in the KV
        pool or no free slot it waits in the queue and recomputes its KV when admitted."""
        from superslm.tokenizer import StreamDecoder

        saved = persist.decode(blob, self.model.fingerprint)
        try:
            st = saved.header["sequence"]
            sampler = SamplerState.from_state(st["sampler"])
            request = Request(prompt=list(st["prompt"]), max_tokens=int(st["request_max_tokens"]),
                              sampling=sampler.params, salt=st["salt"])
            seq = Sequence(self._next_id, request, list(st["prompt"]), int(st["max_tokens"]), sampler,
                           StreamDecoder.from_state(self.model.tokenizer, st["decoder"]),
                           StopChecker.from_state(st["stops"]))
            seq.output = list(st["output"])
            seq.cached, seq.preemptions, seq.layers_run = int(st["cached"]), int(st["preemptions"]), int(st["layers_run"])
        except (KeyError, TypeError, ValueError) as e:
            raise StateCorrupted(f"saved sequence state is malformed ({e})") from e
        sampler.params.validate(self.vocab)
        self._prompt_ids(seq.tokens)  # token ids in range
        if seq.num_tokens > self.context:
            raise ContextLengthExceeded(f"the saved sequence has {seq.num_tokens} tokens; the context holds {self.context}")
        n, ps = saved.k.shape[1], self.page_size
        pages = -(-n // ps)
        self._next_id += 1
        self._seqs[seq.id] = seq
        if n and len(self.scheduler.running) < self.slots and self.pool.can_allocate(pages):
            try:
                seq.block_table = self.pool.allocate(pages)
            except KVCacheFull:
                seq.block_table = []
            if seq.block_table:
                slots = torch.tensor([seq.block_table[p // ps] * ps + p % ps for p in range(n)],
                                     dtype=torch.long, device=self.kv.k.device)
                self.kv.k[:, slots] = saved.k.to(self.kv.k)
                self.kv.v[:, slots] = saved.v.to(self.kv.v)
                seq.num_computed_tokens = n
                self.scheduler.running.append(seq)
                return seq.id
        self.scheduler.add(seq)
        return seq.id

    # --- low-level use ----------------------------------------------------------------------------

    def step(self, tokens: list[int], slots: list[int], wanted: list[bool]) -> torch.Tensor:
        """Low level: append each token row to its slot (0..slots-1, caller-owned sequences sharing
        the KV pool with requests) and return the logits of the wanted rows, in row order."""
        if self._manual is None:
            self._manual = ManualSlots(self.net, self.kv, self.pool, self.slots, self.context)
        return self._manual.step(tokens, slots, wanted)

    def reset(self, slot: int) -> None:
        """Empty a low-level slot (see `step`) and free its pages."""
        if self._manual is not None:
            self._manual.reset(slot)

    # --- conveniences -----------------------------------------------------------------------------

    def generate(self, requests: Iterable[Request]) -> list[Completion]:
        """Run requests to the end, together; results in the order given."""
        ids = [self.add(r) for r in requests]
        done: dict[int, Completion] = {i: Completion(i) for i in ids}
        for i in ids:
            done[i].prompt_tokens = len(self._seqs[i].prompt)
        while any(not c.end for c in done.values()):
            for p in self.advance():
                c = done.get(p.id)
                if c is None:
                    continue
                c.tokens += p.tokens
                c.text += p.text
                c.logprobs += p.logprobs
                c.cached = p.cached
                if p.end:
                    c.end = p.end
        return [done[i] for i in ids]

    def complete(self, prompt: str | list[int], limit: int = 256, sampling: Sampling | None = None) -> str:
        """The text of one request run to the end."""
        req = Request(prompt=prompt, max_tokens=limit, sampling=sampling or Sampling())
        return self.generate([req])[0].text
