"""The stats board: each replica's latest /metrics text, and the merged scrape the ingress answers.

Replicas post after every request and at every health check; the ingress's GET /metrics merges the posts of
the last `STALE_S` seconds into one Prometheus text, every sample labelled with `replica="<id>"` (so a
gateway or Prometheus sees each engine's queue, KV usage and prefix cache apart).
"""

from __future__ import annotations

import time
from typing import Any

import ray

#: a replica that has not posted for this long (health checks post every few seconds) is left out
STALE_S = 30.0
#: where the board actors live
NAMESPACE = "superslm"


@ray.remote(num_cpus=0)
class StatsBoard:
    """replica id -> (metrics text, posted at, pid)."""

    def __init__(self) -> None:
        self.posts: dict[str, tuple[str, float, int]] = {}

    def put(self, replica: str, text: str, at: float, pid: int) -> None:
        self.posts[replica] = (text, at, pid)

    def drop(self, replica: str) -> None:
        self.posts.pop(replica, None)

    def all(self) -> dict[str, tuple[str, float, int]]:
        return dict(self.posts)


def board(name: str) -> Any:
    """The board actor `name` (created by whoever asks first; detached, so it outlives a `ray-deploy`)."""
    return StatsBoard.options(name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()


def _labelled(sample: str, replica: str) -> str:
    label = f'replica="{replica}"'
    name, brace, rest = sample.partition("{")
    if brace:
        return f"{name}{{{label},{rest}" if not rest.startswith("}") else f"{name}{{{label}{rest}"
    name, _, value = sample.partition(" ")
    return f"{name}{{{label}}} {value}"


def merge(posts: dict[str, tuple[str, float, int]], now: float | None = None) -> str:
    """One Prometheus text of every fresh post: each family's HELP and TYPE once, then its samples from every
    replica, each labelled with its replica."""
    now = time.time() if now is None else now
    families: dict[str, list[str]] = {}
    for replica, (text, at, _) in sorted(posts.items()):
        if now - at > STALE_S:
            continue
        current: list[str] | None = None
        for line in text.splitlines():
            if line.startswith("# HELP "):
                name = line.split(" ", 3)[2]
                current = families.get(name)
                if current is None:
                    current = families[name] = [line]
                    current.append("")  # TYPE's place, filled below
            elif line.startswith("# TYPE ") and current is not None:
                current[1] = line
            elif line and current is not None:
                current.append(_labelled(line, replica))
    return "".join(line + "\n" for lines in families.values() for line in lines if line)


def samples(text: str, name: str) -> dict[str, float]:
    """replica -> the value of the unlabelled-by-anything-else sample `name` in a merged text (for tests and
    the benchmark)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{replica="):
            labels, _, value = line[len(name) + 1:].partition("} ")
            if "," not in labels:
                out[labels.split('"')[1]] = float(value)
    return out
