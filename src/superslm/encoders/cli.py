"""`superslm embed` (placeholder until the server lands: registers nothing)."""

from __future__ import annotations

from typing import Any


def add_parser(sub: Any) -> None:
    """Register the `embed` subcommand on the CLI's subparsers."""
