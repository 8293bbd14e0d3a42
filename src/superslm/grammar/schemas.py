"""Named JSON schemas shipped with a model: `schemas/NAME.json` in the model's folder.

`Model.schemas()` lists them (`load_schemas`); `Sampling(schema="NAME")` binds one by name
(`named_constraint`). A name the model does not ship is its own error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from superslm.errors import FormatError, UnknownSchema
from superslm.grammar.spec import Constraint

#: a schema name: what a file stem may be (no path separators, no leading dot)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


def load_schemas(folder: str | Path) -> dict[str, dict[str, Any] | bool]:
    """The JSON schemas a model folder ships, by name: `folder/schemas/NAME.json` -> NAME.

    A folder without `schemas/` has none ({}). Names are sorted. Raises FormatError for a file that
    is not JSON, or whose content is not a schema (an object or a boolean).
    """
    root = Path(folder) / "schemas"
    if not root.is_dir():
        return {}
    out: dict[str, dict[str, Any] | bool] = {}
    for path in sorted(root.glob("*.json")):
        name = path.stem
        if not _NAME.fullmatch(name):
            raise FormatError(f"schema file name {path.name!r} is not a valid schema name")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"schemas/{path.name} is not readable JSON: {e}") from e
        if not isinstance(data, (dict, bool)):
            raise FormatError(f"schemas/{path.name} is not a JSON schema (an object or a boolean)")
        out[name] = data
    return out


def named_constraint(name: str, schemas: Mapping[str, Mapping[str, Any] | bool], **options: Any) -> Constraint:
    """The json_schema constraint of the shipped schema `name` (options go to
    `Constraint.json_schema`, e.g. max_whitespace). Raises UnknownSchema for a name not in `schemas`."""
    if not isinstance(name, str) or name not in schemas:
        known = ", ".join(sorted(schemas)) or "none"
        raise UnknownSchema(f"unknown schema {name!r} (this model ships: {known})")
    return Constraint.json_schema(schemas[name], **options)
