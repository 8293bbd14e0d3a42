"""The runtime contracts of a sequence: stats, save/restore, prefix handles, hidden states.
A mixin of Engine (it uses its fields)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from superslm.cache.kv import slot_mapping
from superslm.engine import persist
from superslm.engine.mtp_drafter import MTPSpeculator
from superslm.engine.request import Request, Sequence
from superslm.errors import (
    AdapterInUse,
    AdapterMismatch,
    ContextLengthExceeded,
    InvalidArgument,
    PrefixInUse,
    SequenceBusy,
    StateCorrupted,
    StateModelMismatch,
    UnknownRequest,
)
from superslm.kernels.attention import AttnMetadata

if TYPE_CHECKING:
    from superslm.engine.engine import Engine
    from superslm.engine.runner import StepWork


@dataclass(eq=False)
class Prefix:
    """A prompt start prefilled once and frozen (`Engine.prefix`); requests adopt it with
    `Request(prefix=...)` and never compute it again. Its full pages are shared in place; the
    last partial page is copied into each adopter."""

    tokens: tuple[int, ...]
    pages: list[int]
    #: the live requests adopting it (ids of their Sequence objects)
    users: set[int] = field(default_factory=set)
    released: bool = False
    #: the engine whose pages these are (a weak reference): another engine's page ids mean other KV
    owner: Callable[[], Any] = field(default=lambda: None, repr=False, compare=False)
    #: delta-rule models: the recurrent states after the prefix (conv, ssm: [layers, ...]), copied to adopters
    states: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    #: an engine drafting with the MTP: the body's normed hidden state at the prefix's last position (that
    #: position's MTP row needs the adopter's first token; engine/mtp_drafter.py)
    hidden: torch.Tensor | None = field(default=None, repr=False, compare=False)


class ContractsMixin:
    """stats / prefill_hidden / save / restore / prefix / release / hidden for Engine."""

    def _live(self: Engine, request_id: int) -> Sequence:
        seq = self.output.seqs.get(request_id)
        if seq is None:
            raise UnknownRequest(f"no live request with id {request_id}")
        return seq

    def _in_step(self: Engine, seq: Sequence) -> bool:
        return self.runner.in_step(seq)

    def stats(self: Engine, request_id: int | None = None) -> dict[str, Any]:
        """Where a live request stands: tokens, layers run, tokens forced by its grammar, KV pages
        resident, cached prompt tokens, whether its grammar accepts here, its drafts proposed and accepted.
        Without an id, the engine's: steps run, preemptions, and its drafts proposed and accepted, the
        acceptance rate and the steps that carried drafts (zeros on an engine that does not draft)."""
        if request_id is None:
            spec = self.speculator
            drafts = spec.stats() if spec is not None else {"drafts_proposed": 0, "drafts_accepted": 0,
                                                            "acceptance_rate": 0.0, "draft_steps": 0}
            return {"steps": self.runner.steps, "preemptions": self.scheduler.num_preemptions, **drafts}
        seq = self._live(request_id)
        g = seq.grammar
        return {
            "drafts_proposed": seq.spec.proposed if seq.spec is not None else 0,
            "drafts_accepted": seq.spec.accepted if seq.spec is not None else 0,
            "prompt_tokens": len(seq.prompt),
            "output_tokens": len(seq.output),
            "num_computed_tokens": seq.num_computed_tokens,
            "layers_run": seq.layers_run,
            "forced_tokens": g.num_forced if g is not None else 0,
            "kv_pages": len(seq.block_table),
            "cached": seq.cached,
            "preemptions": seq.preemptions,
            "grammar_accepting": g.is_accepting if g is not None else None,
            "in_step": self._in_step(seq),
        }

    def expert_counts(self: Engine) -> dict[int, list[int]]:
        """How many tokens the router sent to each expert so far, per layer with experts ({layer: counts});
        empty for a model without experts. Every forward pass counts (requests, prefix handles, `step`)."""
        return {i: layer.mlp.tokens_per_expert.tolist() for i, layer in enumerate(self.net.layers)
                if hasattr(getattr(layer, "mlp", None), "tokens_per_expert")}

    def expert_cache(self: Engine) -> dict[str, Any]:
        """The expert caches' counts (`superslm.load(..., expert_slots=N)`): slots per block, blocks, hits, misses
        and the reads' ms; zeros where every expert is on the device."""
        return self.net.expert_cache()

    def prefill_hidden(self: Engine, request_id: int) -> torch.Tensor | None:
        """The final normed hidden state [dim] at the last prompt position of a live request (None
        until its prompt has been read)."""
        return self._live(request_id).prefill_hidden

    # --- save / restore ---------------------------------------------------------------------------

    def _slots_of(self: Engine, seq: Sequence, n: int) -> torch.Tensor:
        ps = self.page_size
        return torch.tensor(slot_mapping(seq.block_table, 0, n, ps), dtype=torch.long,
                            device=self.kv.k.device)

    def save(self: Engine, request_id: int) -> bytes:
        """The whole state of a live request as a versioned blob (see engine/persist.py)."""
        seq = self._live(request_id)
        if self.runner.in_flight:
            with torch.inference_mode():  # a step launched ahead is accepted (its Progress: next advance)
                self.runner.settle(self.output.pending)
            if seq.end:
                raise UnknownRequest(f"request {request_id} ended in its last step; its Progress says how")
        if self._in_step(seq):
            raise SequenceBusy(f"request {request_id} is mid-step; advance until its step completes")
        slots = self._slots_of(seq, seq.num_computed_tokens)
        state = persist.sequence_state(seq)
        header = {"model": self.model.fingerprint, "page_size": self.page_size, "kv_format": self._page_format(),
                  "sequence": state}
        extra: dict[str, torch.Tensor] = {}
        if self.states is not None and seq.num_computed_tokens:
            # the delta-rule layers' states after the computed tokens, beside their KV
            assert seq.state_slot is not None
            extra["conv"], extra["ssm"] = self.states.rows([seq.state_slot])
        return persist.encode(header, self.kv.k[:, slots], self.kv.v[:, slots], extra)

    def _page_format(self: Engine) -> str:
        """The KV page format a blob names: a quantized format by its name; float pages of any dtype are "float"
        (their values convert exactly enough between float dtypes, and the model fingerprint pins the dtype)."""
        return self.kv.format.name if self.kv.format.quantized else "float"

    def restore(self: Engine, blob: bytes, adapter: Any = None) -> int:
        """A new live request continuing a saved one exactly; returns its id. With no free slot or no
        room in the KV pool it waits in the queue and recomputes its KV when admitted. A request saved with a
        LoRA adapter needs the same adapter (`Model.adapter`, same weights) passed back: AdapterMismatch
        otherwise. Its max_tokens is cut to what this engine's context holds (ContextLengthExceeded if none)."""
        saved = persist.decode(blob, self.model.fingerprint)
        st = persist.check_header(saved.header)
        try:
            self._restored_adapter(st.get("adapter"), adapter)
            prompt = st["prompt"]
            # a well-formed blob (its checksum is no signature) can still hold a prompt the engine cannot run:
            # text (which _prompt_ids would encode), nothing, or what _prompt_ids refuses (not ids, not in vocab)
            if not isinstance(prompt, list) or not prompt:
                raise ValueError("the prompt is not a list of token ids")
            prompt = self._prompt_ids(prompt)
            request = Request(prompt=prompt, max_tokens=int(st["request_max_tokens"]), salt=st["salt"],
                              adapter=adapter)
            seq = self._new_sequence(request, prompt, state=st)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, InvalidArgument) as e:
            raise StateCorrupted(f"saved sequence state is malformed ({e})") from e
        # a smaller context than the saving engine's: the answer stops where this one's ends, as add() cuts it
        seq.max_tokens = min(seq.max_tokens, self.context - len(seq.prompt))
        if len(seq.output) >= seq.max_tokens:
            raise ContextLengthExceeded(f"the saved sequence has {seq.num_tokens} tokens; the context holds "
                                        f"{self.context} (prompt and answer)")
        saved_format = saved.header.get("kv_format", "float")  # blobs before quantized pages held float values
        if saved_format != self._page_format():
            raise StateModelMismatch(f"the sequence was saved with {saved_format} KV pages; this engine keeps "
                                     f"{self._page_format()} pages (restore it into an engine of that kv format)")
        n = saved.k.shape[1]
        # the MTP's KV layers follow the body's: a blob of an engine that drafts with it restores into one that
        # does not (its body's layers), and a blob without them into one that does (that sequence then never
        # drafts: its MTP rows are not there)
        layers, body = self.kv.k.shape[0], self.net.kv_layers
        if self.net.arch.mtp and {saved.k.shape[0], layers} == {body, body + self.net.arch.mtp}:
            layers = body
            saved.k, saved.v = saved.k[:body], saved.v[:body]
        want = (layers, n, *self.kv.k.shape[2:])
        want_v = (layers, n, *self.kv.v.shape[2:])
        if tuple(saved.k.shape) != want or tuple(saved.v.shape) != want_v or n > seq.num_tokens:
            raise StateCorrupted(f"saved KV {tuple(saved.k.shape)} does not fit this engine's cache {want} and "
                                 f"{seq.num_tokens} tokens")
        states = self._saved_states(saved, n)
        self._register(seq)
        if adapter is not None:
            adapter.users.add(id(seq))
        if n and self.scheduler.resume(seq, n):
            slots = self._slots_of(seq, n)
            self.kv.k[:layers, slots] = saved.k.to(self.kv.k)
            self.kv.v[:layers, slots] = saved.v.to(self.kv.v)
            if layers < self.kv.k.shape[0]:
                seq.mtp_rows = 0
            if states is not None and self.states is not None and seq.state_slot is not None:
                self.states.write([seq.state_slot], *states)
            seq.num_computed_tokens = n
        else:
            self.scheduler.add(seq)
        return seq.id

    def _saved_states(self: Engine, saved: persist.SavedSequence, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The recurrent states a blob carries after its n computed tokens, checked against this engine's (a
        delta-rule model's blob without them, or a blob with them for a model without such layers, is refused:
        its KV alone cannot resume it)."""
        if self.states is None:
            if saved.extra:
                raise StateCorrupted(f"saved sequence carries {sorted(saved.extra)} this model has no use for")
            return None
        if not n:
            return None
        conv, ssm = saved.extra.get("conv"), saved.extra.get("ssm")
        want_conv = (self.states.conv.shape[0], 1, *self.states.conv.shape[2:])
        want_ssm = (self.states.ssm.shape[0], 1, *self.states.ssm.shape[2:])
        if conv is None or ssm is None or tuple(conv.shape) != want_conv or tuple(ssm.shape) != want_ssm:
            raise StateCorrupted("saved sequence lacks the recurrent states of this model's delta-rule layers "
                                 f"(conv {want_conv}, ssm {want_ssm})")
        if not (torch.isfinite(conv).all() and torch.isfinite(ssm).all()):
            raise StateCorrupted("saved recurrent states hold NaN or infinite values")
        return conv, ssm

    def _copy_state(self: Engine, seq: Sequence) -> None:
        """The recurrent states after a sequence's computed prefix into its row (for the scheduler): its prefix
        handle's, or the checkpoint after its last cached page."""
        if self.states is None or seq.state_slot is None:
            return
        pre = seq.request.prefix
        if pre is not None:
            if pre.states is not None:
                self.states.write([seq.state_slot], *pre.states)
            return
        key = self.pool.hash_of(seq.block_table[seq.num_computed_tokens // self.page_size - 1])
        row = None if key is None or self.checkpoints is None else self.checkpoints.find(key)
        if row is None or self.saved_states is None:  # usable_prefix found it a moment ago
            raise AssertionError("a cached prefix was resumed without its checkpointed states")
        self.states.copy_row(self.saved_states, row, seq.state_slot)

    def _usable_prefix(self: Engine, pages: list[int]) -> int:
        """How many of a prefix cache match's pages have their states checkpointed after them (the longest run)."""
        assert self.checkpoints is not None
        for k in range(len(pages), 0, -1):
            key = self.pool.hash_of(pages[k - 1])
            if key is not None and self.checkpoints.find(key) is not None:
                return k
        return 0

    def _keep_state(self: Engine, seq: Sequence, row: int) -> None:
        """seq's recurrent states := those of scratch row `row`, the states after its last kept draft row (for the
        scheduler's rollback)."""
        assert self.states is not None and seq.state_slot is not None
        self.states.copy_row(self.states, row, seq.state_slot)

    def _checkpoint_states(self: Engine, work: StepWork) -> None:
        """After a step is accepted: the states of each running sequence at each page boundary its verified tokens
        reached, kept under the hash of the page that ends there (what a later prompt starting the same way resumes
        from). A boundary inside a step's kept draft rows takes the states its scratch row kept after that row;
        rows past the kept ones never reach a checkpoint."""
        if self.checkpoints is None or self.saved_states is None or self.states is None:
            return
        ps = self.page_size
        for i, (seq, rows) in enumerate(work.chunks):
            n = seq.num_computed_tokens
            if seq.state_slot is None or not n or not self.scheduler.prefix_caching:
                continue
            start = work.meta.seq_lens[i] - rows  # the computed tokens before the step
            scratch = work.draft_states(i)  # scratch[j]: the states after start + j + 1 tokens
            ends = [(b, scratch[b - start - 1]) for b in range(start - start % ps + ps, n, ps) if scratch]
            if n % ps == 0:
                ends.append((n, seq.state_slot))
            if not ends:
                continue
            self.scheduler.register(seq)  # the pool hashes its new full pages, chained on the ones before
            for b, row in ends:
                key = self.pool.hash_of(seq.block_table[b // ps - 1])
                if key is not None:
                    self.saved_states.copy_row(self.states, row, self.checkpoints.claim(key))

    def _check_adapter(self: Engine, adapter: Any) -> None:
        from superslm.adapters import Adapter

        if not isinstance(adapter, Adapter) or adapter.model_fingerprint != self.model.fingerprint:
            raise AdapterMismatch("the adapter was not mapped onto this engine's model (Model.adapter)")
        if adapter.unmapped:
            raise AdapterInUse("the adapter has been unmapped")

    def _restored_adapter(self: Engine, saved: Any, adapter: Any) -> None:
        """Refuse (AdapterMismatch) an adapter that is not the one the saved request ran with."""
        if saved is None:
            if adapter is not None:
                raise AdapterMismatch("the saved request ran without an adapter; restore it without one")
            return
        if adapter is None:
            raise AdapterMismatch(f"the saved request ran with adapter {saved['name']!r}: pass it to "
                                  "restore(blob, adapter=...)")
        self._check_adapter(adapter)
        if adapter.fingerprint != saved["fingerprint"]:
            raise AdapterMismatch(f"adapter {adapter.name!r} is not the one the saved request ran with "
                                  f"({saved['name']!r}, other weights)")

    # --- prefix handles ---------------------------------------------------------------------------

    def prefix(self: Engine, tokens: list[int]) -> Prefix:
        """Prefill `tokens` once and freeze them as a shared prompt start (see Prefix)."""
        ids = self._prompt_ids(tokens)
        if not ids:
            raise InvalidArgument("a prefix needs at least one token")
        if len(ids) >= self.context:
            raise ContextLengthExceeded(f"a prefix of {len(ids)} tokens leaves no room in a context of {self.context}")
        ps = self.page_size
        pages = self.scheduler.grant(-(-len(ids) // ps))
        meta = AttnMetadata(
            positions=torch.arange(len(ids), device=self.net.device),
            slot_mapping=torch.tensor(slot_mapping(pages, 0, len(ids), ps), device=self.net.device),
            query_start=(0, len(ids)), seq_lens=(len(ids),), block_tables=(tuple(pages),), page_size=ps,
            deterministic=self.deterministic,
            state_slots=() if self.states is None else (self.states.slots - 1,),  # the prefill's own row
        )
        with torch.inference_mode():
            h = self.net.run_layers(self.net.embed(torch.tensor(ids, device=self.net.device)), meta, self.kv.k,
                                    self.kv.v, states=self.states)
            hidden = None
            if isinstance(self.speculator, MTPSpeculator):
                hidden = self.speculator.prefix_rows(h[: len(ids)], ids, pages)
        # with the MTP, the page of the last position waits for its MTP row (each adopter writes its own copy)
        self.scheduler.cache_pages(pages, ids[:-1] if self.scheduler.mtp else ids)
        states = None if self.states is None else self.states.rows([self.states.slots - 1])
        return Prefix(tuple(ids), pages, owner=weakref.ref(self), states=states, hidden=hidden)

    def release(self: Engine, prefix: Prefix) -> None:
        """Give a prefix's pages back; refused while live requests use it, or for another engine's handle."""
        if not isinstance(prefix, Prefix) or prefix.owner() is not self:
            raise InvalidArgument("prefix must be a handle from this engine's prefix()")
        if prefix.users:
            raise PrefixInUse(f"the prefix is used by {len(prefix.users)} live request(s)")
        if not prefix.released:
            self.scheduler.free(prefix.pages)
            prefix.released = True

    def _copy_page(self: Engine, src: int, dst: int, n: int) -> None:
        """The KV of page src's first n slots into page dst (a prefix's partial page, for the scheduler)."""
        offsets = torch.arange(n, device=self.kv.k.device)
        a, b = offsets + src * self.page_size, offsets + dst * self.page_size
        self.kv.k[:, b] = self.kv.k[:, a]
        self.kv.v[:, b] = self.kv.v[:, a]

    # --- hidden states ------------------------------------------------------------------------------

    def hidden(self: Engine, tokens: list[int], slots: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
        """Low level, like `step`: append token rows to caller-owned slots and return the residual
        stream after each asked layer as transformers' hidden_states counts them (0: the embeddings,
        i: after layer i; the last, i == layers, after the final norm), each [rows, dim] float32."""
        return self._manual_slots().hidden(tokens, slots, layers)
