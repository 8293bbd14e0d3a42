"""What happens to a step's logits: grammar masks, sampling or damped greedy, jump-forward, stop
tokens and strings, text, and the end of a sequence. The output processor owns the live sequences and
the Progress not yet reported; the scheduler frees a finished one's pages."""

from __future__ import annotations

import math

import torch

from superslm.engine.masks import apply_row, banned_tokens
from superslm.engine.request import (
    END_CANCELLED,
    END_GRAMMAR,
    END_LENGTH,
    END_NOT_FINITE,
    END_STOP,
    Progress,
    Sequence,
)
from superslm.engine.runner import StepWork, step_greedy
from superslm.engine.scheduler import Scheduler
from superslm.engine.speculative import Speculator
from superslm.models.transformer import Transformer
from superslm.sampling import TokenLogprobs, sample
from superslm.sampling.damped import damped_choice
from superslm.sampling.sampler import logprobs_of


class OutputProcessor:
    """Turns each step's logits (or certified greedy tokens) into tokens, text and Progress: one `accept`
    per step. Holds the live sequences by id (`seqs`) and the Progress reported by the next advance
    (`pending`: ends outside a step, tokens a grammar forces at the start)."""

    def __init__(self, net: Transformer, scheduler: Scheduler, stop_ids: frozenset[int], vocab: int,
                 jump_forward: bool = True, speculator: Speculator | None = None) -> None:
        self.net, self.scheduler, self.stop_ids, self.vocab = net, scheduler, stop_ids, vocab
        #: proposes each decoding sequence's drafts once its step is accepted (None: the engine does not draft)
        self.speculator = speculator
        #: append the tokens a grammar forces without sampling them (off: mask and sample each)
        self.jump_forward = jump_forward
        self.seqs: dict[int, Sequence] = {}
        self.pending: list[Progress] = []

    def start(self, seq: Sequence) -> None:
        """A new sequence: jump-forward over the tokens its grammar forces before any choice (not where
        logprobs are asked for: every token of the answer gets its logprob, so each one is computed)."""
        params = seq.sampler.params
        if seq.grammar is None or not self.jump_forward or params.logprobs is not None \
                or params.prompt_logprobs is not None:
            return
        forced = seq.grammar.take_forced(seq.max_tokens)
        if forced:
            p = Progress(seq.id)
            for t in forced:
                seq.sampler.append_token(t)
                if self.append(seq, t, p):
                    break  # the forced tokens reached max_tokens or a stop string: p is the last report
            self.pending.append(p)

    def greedy_tokens(self, work: StepWork) -> torch.Tensor | None:
        """The sampling rows' tokens straight from the head when every one is plain greedy (no logprobs,
        logit_bias, penalties, grammar or damping): `step_greedy` certifies each argmax without computing
        all the logits; None where it does not apply (the step then computes its logits)."""
        for i, ((seq, _), row) in enumerate(zip(work.chunks, work.sample_rows)):
            p = seq.sampler.params
            drafts = work.drafts_of(i)
            plain = (p.greedy and p.logprobs is None and not p.logit_bias and not p.uses_penalties
                     and seq.allowed is None
                     and not any(self.banned(seq, drafts[:j]) for j in range(len(drafts) + 1)))
            if row >= 0 and not (plain and p.damped is None and seq.grammar is None):
                return None
        return step_greedy(self.net, work)

    def accept(self, work: StepWork, logits: torch.Tensor | None,
                tokens: torch.Tensor | None = None) -> list[Progress]:
        """A finished step's tokens into its sequences: `logits` of its logit rows (`StepWork.logit_rows`), or the
        rows' `tokens` certified by the head. A chunk with drafts keeps those its rows' choices agree with and the
        token after; its other rows are rolled back. Then each decoding sequence's next drafts are proposed."""
        seqs: list[tuple[Sequence, tuple[int, ...], tuple[int, ...]]] = []
        for i, ((seq, n), row) in enumerate(zip(work.chunks, work.sample_rows)):
            drafts = work.drafts_of(i)
            seq.num_computed_tokens += n - len(drafts)  # a draft's K/V counts once the draft is accepted
            if row >= 0:
                seqs.append((seq, drafts, work.draft_states(i)))
                if seq.prefill_hidden is None and work.h is not None:
                    # the prefill hidden state: final norm at the last prompt position
                    seq.prefill_hidden = self.net.final_norm(work.h[row - len(drafts)]).float().clone()
            elif not seq.end:
                self.scheduler.register(seq)
        out: list[Progress] = []
        if seqs:
            # one sampling row per logit row: a draft row j samples as plain decoding would once drafts[:j] are in
            rows = [(seq, drafts[:j]) for seq, drafts, _ in seqs for j in range(len(drafts) + 1)]
            if tokens is not None:  # plain greedy rows, certified by the head (greedy_tokens)
                bitmask, chosen, logprobs = None, tokens.tolist(), [None] * len(rows)
            else:
                assert logits is not None
                bitmask = self.bitmask(rows)
                states = [seq.sampler.ahead(ahead) if ahead else seq.sampler for seq, ahead in rows]
                result = sample(logits, states, bitmask=bitmask)
                chosen, logprobs = result.token_list(), result.logprobs()
            r = 0
            for seq, drafts, states in seqs:
                first, r = r, r + len(drafts) + 1
                if seq.end == END_CANCELLED:
                    self.finish(seq, END_CANCELLED, into=out)
                    continue
                p = self.verify(seq, drafts, chosen[first:r], logprobs[first:r],
                                None if logits is None else logits[first : first + 1],
                                None if bitmask is None else bitmask[first : first + 1], states)
                out.append(p)
        for seq, _ in work.chunks:
            if seq.end == END_CANCELLED and seq.id in self.seqs:
                self.finish(seq, END_CANCELLED, into=out)
        if self.speculator is not None:
            decoding = [seq for seq, _, _ in seqs
                        if seq.id in self.seqs and seq.num_tokens - seq.num_computed_tokens == 1]
            for seq, drafts in zip(decoding, self.speculator.propose_all(decoding, work), strict=True):
                seq.drafts = drafts
        return out

    def verify(self, seq: Sequence, drafts: tuple[int, ...], chosen: list[int], logprobs: list[TokenLogprobs | None],
               logits: torch.Tensor | None, bitmask: torch.Tensor | None, states: tuple[int, ...] = ()) -> Progress:
        """Take seq's tokens of one step: `chosen[j]` is row j's choice (row 0 its newest token's, row j > 0 after
        drafts[:j]); draft j is kept while the choices before it kept theirs and row j chose it, and the choice
        after the last kept draft is the step's last token. Rows of drafts not kept are rolled back: the pages past
        the computed tokens go back to the scheduler, and a delta-rule model's recurrent states are those after
        the last kept row (`states[j]`: the scratch row holding them after row j < len(drafts)). `logits`,
        `bitmask`: row 0's (a damped-greedy row's choice)."""
        p = Progress(seq.id, cached=seq.cached)
        accepted = 0
        for j, token in enumerate(chosen):
            if j:
                seq.num_computed_tokens += 1  # draft j - 1 is an output token now: its row's K/V holds
            damped = seq.sampler.params.damped
            if damped is not None:  # never drafted: row 0 alone
                assert logits is not None
                row = logits.clone()
                if bitmask is not None:
                    from superslm.sampling import apply_token_bitmask

                    apply_token_bitmask(row, bitmask)
                token = damped_choice(row[0].log_softmax(-1), seq.anti, damped)
            last = j == len(drafts) or token != drafts[j]
            # jump-forward only after the step's last token: draft rows past it already sample what a grammar
            # forces (their masks allow it alone), and forced tokens appended between would shift them
            self.take(seq, token, logprobs[j], p, jump=last)
            if seq.end or last:
                break
            accepted += 1
        if drafts:
            if self.speculator is not None:
                self.speculator.record(seq, len(drafts), accepted)
            if not seq.end:
                # rows 0..accepted are kept; the state row holds the state after the last row computed
                kept = states[accepted] if states and accepted < len(drafts) else None
                self.scheduler.rollback(seq, kept)
        return p

    def banned(self, seq: Sequence, ahead: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The tokens seq may not sample next (min_tokens' stop tokens, bad words; engine/masks.py), once the
        drafts `ahead` are in its output (a draft row's)."""
        output = seq.output + list(ahead) if ahead else seq.output
        return banned_tokens(output, seq.sampler.params, self.stop_ids, seq.bad_words)

    def prompt_logprobs(self, work: StepWork) -> None:
        """For each chunk of a prompt whose request asks for prompt_logprobs: the logprob of every prompt token
        its rows predict (row of position q -> prompt[q + 1]), from the raw logits as the sampler's logprobs."""
        for (seq, n), row0 in zip(work.chunks, work.meta.query_start):
            k = seq.sampler.params.prompt_logprobs
            first = seq.num_computed_tokens  # accept has not counted this chunk yet
            last = min(first + n, len(seq.prompt) - 1)  # positions first..last-1 predict a prompt token
            if seq.prompt_logprobs is None or last <= first:
                continue
            assert work.h is not None and k is not None
            for a in range(first, last, 64):  # 64 rows of [vocab] logits at a time
                b = min(a + 64, last)
                rows = torch.arange(row0 + a - first, row0 + b - first, device=work.h.device)
                logits = self.net.logits(work.h.index_select(0, rows), work.meta.deterministic)
                target = torch.tensor(seq.prompt[a + 1 : b + 1], device=logits.device)
                chosen, ranks, values, ids = (t.tolist() for t in logprobs_of(logits, target, k))
                for j, lp_j in enumerate(chosen):
                    top = tuple(zip(ids[j], values[j], strict=True))
                    seq.prompt_logprobs[a + 1 + j] = TokenLogprobs(seq.prompt[a + 1 + j], lp_j, ranks[j], top)

    def bitmask(self, rows: list[tuple[Sequence, tuple[int, ...]]]) -> torch.Tensor | None:
        """int32 [rows, ceil(vocab / 32)] of the tokens each row (a sequence, and the drafts before it) may sample
        (grammar masks, allowed_token_ids, min_tokens' and bad words' bans), or None where every row may sample
        any token. A row after drafts gets its grammar's mask as it will be once they are accepted."""
        bans = [self.banned(s, ahead) for s, ahead in rows]
        seqs = [s for s, _ in rows]
        grammar = any(s.grammar is not None for s in seqs)
        if not grammar and not any(bans) and all(s.allowed is None for s in seqs):
            return None
        words = -(-self.vocab // 32)
        bitmask = torch.full((len(seqs), words), -1, dtype=torch.int32)
        if grammar:
            from superslm.grammar import fill_bitmasks

            # the sequences' own positions at once (llguidance's executor), then each one's draft rows
            first = [i for i, (_, ahead) in enumerate(rows) if not ahead]
            own = bitmask[first]  # a copy: indexing by a list
            fill_bitmasks([seqs[i].grammar for i in first], own)
            bitmask[first] = own
            for i in first:
                seq, d = seqs[i], 0
                while i + d + 1 < len(rows) and rows[i + d + 1][0] is seq:
                    d += 1
                if d and seq.grammar is not None:
                    seq.grammar.fill_bitmasks_along(rows[i + d][1], bitmask[i : i + d + 1])
        for row, (seq, banned) in enumerate(zip(seqs, bans, strict=True)):
            apply_row(bitmask[row], seq.allowed, banned)
        return bitmask.to(self.net.device)

    def take(self, seq: Sequence, token: int, lp: TokenLogprobs | None, p: Progress | None = None,
             jump: bool = True) -> Progress:
        """Accept one sampled token, then any tokens the grammar forces after it unless `jump` is False (reported
        in `p`, or a new Progress)."""
        if p is None:
            p = Progress(seq.id, cached=seq.cached)
        if seq.grammar is not None and seq.grammar.is_dead:
            # its mask allowed nothing (an llguidance error, or a dead end): the sampled token is noise
            return self.finish(seq, END_GRAMMAR, progress=p)
        if lp is not None and math.isnan(lp.logprob):
            # NaN logits (overflowed activations) sample noise; its logprobs would be no number at all
            return self.finish(seq, END_NOT_FINITE, progress=p)
        seq.sampler.append_token(token)
        if seq.prompt_logprobs is not None:  # the prompt is read: its logprobs go out once, with its first token
            p.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        if lp is not None:
            p.logprobs.append(lp)
        params = seq.sampler.params
        stop = token in params.stop_token_ids or (token in self.stop_ids and not params.ignore_eos)
        if seq.grammar is not None and not seq.grammar.accept(token) and not stop:
            return self.finish(seq, END_GRAMMAR, progress=p)
        if stop:
            seq.stop_reason = token
            return self.finish(seq, END_STOP, progress=p)
        if self.append(seq, token, p):
            return p
        if seq.grammar is not None:
            # jump-forward: tokens the grammar allows as the only continuation, without sampling
            jump = jump and self.jump_forward and params.logprobs is None  # logprobs: every token computed (add)
            limit = max(0, seq.max_tokens - len(seq.output)) if jump else 0
            for forced in seq.grammar.take_forced(limit):
                seq.sampler.append_token(forced)
                if self.append(seq, forced, p):
                    return p
            if seq.grammar.is_dead:
                return self.finish(seq, END_GRAMMAR, progress=p)
            if params.ignore_eos and seq.grammar.is_finished:
                return self.finish(seq, END_STOP, progress=p)
        self.scheduler.register(seq)
        return p

    def append(self, seq: Sequence, token: int, p: Progress) -> bool:
        """One output token: text, stop strings, max_tokens. True when the sequence ended."""
        seq.output.append(token)
        if seq.anti is not None:
            seq.anti.append(token)
        p.tokens.append(token)
        piece = seq.decoder.push(token)
        if not seq.stops.stop:  # no stop strings: every piece passes (StopChecker.push's answer, without it)
            p.text += piece
        else:
            # stop strings count from min_tokens on (one may start in the text before, as vLLM looks back)
            res = seq.stops.push(piece, check=len(seq.output) >= seq.sampler.params.min_tokens)
            p.text += res.text
            if res.stopped:
                seq.stop_reason = res.stop
                self.finish(seq, END_STOP, progress=p)
                return True
        if len(seq.output) >= seq.max_tokens:
            self.finish(seq, END_LENGTH, progress=p)
            return True
        return False

    def finish(self, seq: Sequence, end: str, progress: Progress | None = None,
                into: list[Progress] | None = None) -> Progress:
        """End a sequence: flush its held text, free its pages, and report it."""
        p = progress or Progress(seq.id, cached=seq.cached)
        if end != END_STOP or seq.stop_reason is None or isinstance(seq.stop_reason, int):
            # a stop string ends the text where it starts; anything else releases what was held
            p.text += seq.stops.push(seq.decoder.flush()).text + seq.stops.flush()
        seq.end, p.end, p.stop_reason = end, end, seq.stop_reason
        p.forced_tokens = seq.grammar.num_forced if seq.grammar is not None else 0
        self.scheduler.remove(seq)
        self.seqs.pop(seq.id, None)
        if progress is None:
            (self.pending if into is None else into).append(p)
        return p
