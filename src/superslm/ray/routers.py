"""Request routers on Ray Serve's public request-router interface (`ray.serve.request_router`).

`PrefixAffinityRouter`: load balance first, then prefix affinity. Only the replicas whose in-flight count is
within `imbalanced_threshold` of the least loaded one are eligible; among them the request goes to the replica
that has seen the longest run of its leading text (chained hashes of `chunk_chars` characters, as the engine's
prefix cache chains page hashes), and where none has seen a tenth of it, to the replica holding the least
text. Ray's own PrefixCacheAffinityRouter follows the same policy but its public module needs `ray[llm]`
(vLLM), which a CPU server should not install.

`RoundRobinRouter`: each request to the next replica in turn (the baseline of benchmarks/ray_prefix.py).

Both read the routing text from the call's first argument (`bridge.Carried.routing_text`); a call without one
is routed by load alone.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica


def routing_text(pending: PendingRequest | None) -> str:
    """The text a request's prompt starts with ('' where it has none)."""
    if pending is None or not pending.args:
        return ""
    return str(getattr(pending.args[0], "routing_text", "") or "")


def chunk_hashes(text: str, chunk_chars: int) -> list[bytes]:
    """Chained hashes of the text's full chunks: equal hashes mean equal text up to that chunk's end."""
    out, parent = [], b""
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        parent = hashlib.blake2b(parent + text[start:start + chunk_chars].encode(), digest_size=12).digest()
        out.append(parent)
    return out


class PrefixAffinityRouter(RequestRouter):
    """Load balance first, then the replica whose cache most likely holds the prompt's prefix (module doc)."""

    def initialize_state(self, imbalanced_threshold: int = 2, chunk_chars: int = 128, match_rate: float = 0.1,
                         max_chunks: int = 50_000, **kwargs: Any) -> None:
        """`imbalanced_threshold`: in-flight requests a replica may have beyond the least loaded and still be
        chosen for affinity; `chunk_chars`: the text matched per hash; `match_rate`: the least share of a
        prompt's chunks a replica must have seen to win it; `max_chunks`: chunk hashes remembered per replica
        (least recently used go first, as the replica's own cache evicts)."""
        self.threshold = int(imbalanced_threshold)
        self.chunk_chars = int(chunk_chars)
        self.match_rate = float(match_rate)
        self.max_chunks = int(max_chunks)
        self.seen: dict[ReplicaID, OrderedDict[bytes, None]] = {}
        self.inflight: dict[ReplicaID, set[str]] = {}

    def _load(self, replica: RunningReplica) -> int:
        return len(self.inflight.get(replica.replica_id, ()))

    def _matched(self, replica: RunningReplica, hashes: list[bytes]) -> int:
        seen = self.seen.get(replica.replica_id)
        n = 0
        while seen is not None and n < len(hashes) and hashes[n] in seen:
            n += 1
        return n

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Every candidate, best first, one per rank (Ray tries the ranks in order)."""
        if not candidate_replicas:
            return []
        order = sorted(candidate_replicas, key=lambda r: (self._load(r), random.random()))
        least = self._load(order[0])
        eligible = [r for r in order if self._load(r) - least <= self.threshold]
        hashes = chunk_hashes(routing_text(pending_request), self.chunk_chars)
        if hashes:
            best = max(eligible, key=lambda r: (self._matched(r, hashes), -self._load(r)))
            if self._matched(best, hashes) < self.match_rate * len(hashes):
                # nobody holds it: the replica holding the least text, so new prefixes spread
                best = min(eligible, key=lambda r: (len(self.seen.get(r.replica_id, ())), self._load(r)))
            order.remove(best)
            order.insert(0, best)
        if pending_request is not None:
            # counted in flight on its first choice now: requests routed at once see each other's load
            self.inflight.setdefault(order[0].replica_id, set()).add(pending_request.metadata.internal_request_id)
        return [[r] for r in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """Count it in flight on `replica_id` (only there: Ray may have taken another rank than the first) and
        remember its prefix there."""
        rid = pending_request.metadata.internal_request_id
        for other, ids in self.inflight.items():
            if other != replica_id:
                ids.discard(rid)
        self.inflight.setdefault(replica_id, set()).add(rid)
        seen = self.seen.setdefault(replica_id, OrderedDict())
        for h in chunk_hashes(routing_text(pending_request), self.chunk_chars):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_chunks:
            seen.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """No longer in flight (finished, failed or cancelled)."""
        self.inflight.get(replica_id, set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget a dead replica's prefixes: its cache died with it."""
        super().on_replica_actor_died(replica_id)
        self.seen.pop(replica_id, None)
        self.inflight.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's update, then forget the replicas that left."""
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [rid for rid in self.seen if rid not in live]:
            del self.seen[gone]
        for gone in [rid for rid in self.inflight if rid not in live]:
            del self.inflight[gone]


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in turn (by replica id), the next ones after it as fallbacks."""

    def initialize_state(self, **kwargs: Any) -> None:
        """No settings."""
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The replica whose turn it is first, then the others in order."""
        if not candidate_replicas:
            return []
        order = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        k = self.turn % len(order)
        self.turn += 1
        return [[r] for r in order[k:] + order[:k]]
