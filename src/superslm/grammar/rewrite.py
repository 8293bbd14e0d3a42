"""A JSON schema as SuperSLM hands it to llguidance: the same instances, two holes closed.

- **Keys.** llguidance writes an object's additional keys as any raw JSON string other than the
  declared names, so `{"\\u0061": "x"}` passed `{"properties": {"a": {"type": "number"}}}`: the key
  decodes to "a" and its value escaped a's schema. Its pattern keys, though, are written in the one
  canonical JSON form of their decoded text. So every object schema that declares names and admits
  other keys is rewritten: those other keys become a pattern property whose pattern matches every
  name except the declared ones (`additionalProperties` false), which admits the same objects. Not
  rewritten: an object with pattern properties of its own that admits other keys too, and a schema where
  llguidance's merging of objects (allOf, `$ref` beside keywords) makes two such patterns overlap.
  There no regex can be written (llguidance wants the complement of the patterns), so that whole
  schema is compiled with `json_allowed_escapes` without `u`: every string, keys included, has one
  spelling (raw UTF-8, `\\"`, `\\\\` and `\\b\\f\\n\\r\\t`; `\\/` and surrogate pairs never), so llguidance's
  raw-text matching of keys is matching of their decoded text. The price, in those schemas only: a
  string cannot hold the other control characters or DEL. The same holds where a declared name has
  a control character or DEL beside pattern properties (`a\\u000a` is llguidance's other spelling of
  "a\\n", matched by a pattern but not excluded as the name), and where `keys` is off.
- **Times.** llguidance's `time` and `date-time` accept a leap second (`:60`) at any hour; RFC 3339
  has one only at 23:59:60 UTC. Those formats are replaced by a pattern that allows `:60` only where
  the time, less its offset, is 23:59. Its `date` (and a `date-time`'s date) takes 29 February in any
  year and the year 0000; the pattern follows the calendar.

The rewrite only narrows what llguidance would write; the schema a caller gave is what the output is
checked against.
"""

from __future__ import annotations

import copy
import re
from functools import lru_cache
from typing import Any

# keywords whose value is one subschema, a list of them, or a name -> subschema map
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "allOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def for_llguidance(schema: Any, keys: bool = True) -> Any:
    """A copy of `schema` with exact leap seconds and, with `keys`, canonical additional keys (see the
    module doc); `schema` itself is not changed. A schema that refers into an `additionalProperties` by
    `$ref` keeps its objects as they are (the rewrite would move what the reference points at)."""
    out = copy.deepcopy(schema)
    keys = keys and "additionalProperties" not in "".join(_refs(out))
    closed: set[int] = set()
    _walk(out, keys, closed=closed)
    if isinstance(out, dict) and not _exact_keys(out, closed):
        own = out.get("x-guidance")
        options = dict(own) if isinstance(own, dict) else {}
        options["json_allowed_escapes"] = str(options.get("json_allowed_escapes", _ESCAPES)).replace("u", "")
        out["x-guidance"] = options
    return out


#: JSON's escapes but `\\u`: each string then has one spelling, which llguidance's key rules compare
_ESCAPES = 'nrbtf\\"'


def _dicts(node: Any) -> list[dict[str, Any]]:
    """Every object in `node` (a subschema under any keyword may be a `$ref` target), itself first."""
    if isinstance(node, dict):
        return [node] + [d for v in node.values() for d in _dicts(v)]
    if isinstance(node, list):
        return [d for v in node for d in _dicts(v)]
    return []


def _exact_keys(schema: dict[str, Any], closed: set[int]) -> bool:
    """Whether llguidance, given `schema` (rewritten), writes no key whose decoded text could take a
    declared name's or pattern's place: no object that declares names or patterns leaves other keys to
    llguidance's own rule (raw JSON text) unless a parent it is merged into refuses them (`closed`), and
    no name with a control character or DEL (two spellings) sits beside a pattern."""
    nodes = _dicts(schema)
    names: set[str] = set()
    patterns = False
    for node in nodes:
        props, required = node.get("properties"), node.get("required")
        mine = [*(props if isinstance(props, dict) else ()), *(required if isinstance(required, list) else ())]
        names |= {n for n in mine if isinstance(n, str)}
        patterns = patterns or bool(node.get("patternProperties"))
        if (mine or node.get("patternProperties")) and node.get("additionalProperties", True) is not False \
                and id(node) not in closed:
            return False
    return not (patterns and any(re.search("[\\x00-\\x1f\\x7f]", n) for n in names))


def merged_patterns(error: str) -> bool:
    """Whether llguidance refused a rewritten schema because it merges objects (`allOf`, a `$ref` with
    sibling keywords) whose pattern properties overlap: that schema is compiled without the key rewrite."""
    return "are not disjoint" in error


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


_OBJECT_KEYS = ("properties", "required", "additionalProperties", "patternProperties")
_MERGED = ("allOf", "anyOf", "oneOf")


def _walk(node: Any, keys: bool, merged: bool = False, closed: set[int] | None = None) -> None:
    """Rewrite `node` and its subschemas in place; `merged`: llguidance intersects this node with its
    parent (a branch of allOf, an option beside the parent's own object keywords), so its keys are
    rewritten at the parent, where all of them are known. `closed` gathers the ids of branches merged
    into a parent that refuses other keys (theirs are refused too)."""
    if not isinstance(node, dict):
        return
    closed = set() if closed is None else closed
    own = any(k in node for k in _OBJECT_KEYS)
    for k in _ONE:
        if isinstance(node.get(k), dict):
            _walk(node[k], keys, closed=closed)
    for k in _LIST:
        if isinstance(node.get(k), list):
            into = k == "allOf" or (k in _MERGED and own)
            for sub in node[k]:
                _walk(sub, keys, merged=into, closed=closed)
    if isinstance(node.get("items"), list):  # draft 4-7 tuple items
        for sub in node["items"]:
            _walk(sub, keys, closed=closed)
    for k in _MAP:
        if isinstance(node.get(k), dict):
            for sub in node[k].values():
                _walk(sub, keys, closed=closed)
    if keys and not merged:
        _canonical_keys(node)
    if node.get("additionalProperties") is False or id(node) in closed:
        # llguidance intersects merged branches with this node: other keys are refused in all of them
        for k in _MERGED:
            if isinstance(node.get(k), list) and (k == "allOf" or own):
                closed.update(id(b) for b in node[k] if isinstance(b, dict))
    fmt = node.get("format")
    if fmt in ("time", "date", "date-time"):  # format applies to strings alone, whatever the type says
        del node["format"]
        exact = {"pattern": f"^(?:{_FORMATS[fmt]})$"}
        if "pattern" in node:
            node.setdefault("allOf", []).append(exact)  # llguidance intersects the two patterns
        else:
            node.update(exact)


def _open(node: dict[str, Any]) -> bool:
    """Whether an object schema admits any other key with any value (no pattern keys, nothing refused)."""
    return node.get("additionalProperties", True) in (True, {}) and "patternProperties" not in node


def _names(node: dict[str, Any]) -> set[str] | None:
    """The names `node` declares (properties and required), None where they are not plain data."""
    props, required = node.get("properties", {}), node.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        return None
    return set(props) | {r for r in required if isinstance(r, str)}


def _canonical_keys(node: dict[str, Any]) -> None:
    """Other keys of an object that declares names as a pattern property excluding those names. A node
    merged with branches (allOf, or anyOf/oneOf beside its own keywords) does so only when it and every
    branch are open: then its pattern excludes every branch's names and no two patterns overlap."""
    extra = node.get("additionalProperties", True)
    names = _names(node)
    # an object with pattern properties of its own keeps llguidance's rule: ours would overlap them, and
    # llguidance refuses overlapping patterns (their complement is no regex we can write)
    if extra is False or not isinstance(extra, (dict, bool)) or names is None or "patternProperties" in node:
        return
    branches = [b for k in _MERGED if isinstance(node.get(k), list) for b in node[k]]
    # names the branches declare, which the node must declare too (as anything: it is open) once it
    # refuses other keys
    theirs: list[str] = []
    if node.get("allOf") or (branches and any(k in node for k in _OBJECT_KEYS)):
        if not _open(node) or not all(isinstance(b, dict) and _open(b) for b in branches):
            return
        for b in branches:
            more = _names(b)
            if more is None:
                return
            theirs += [n for n in [*b.get("properties", {}), *b.get("required", [])] if isinstance(n, str)]
            names |= more
    if not names:
        return
    schema = {} if extra is True else extra
    # a required name without a schema of its own takes the additional one (llguidance reads it from
    # `additionalProperties`, which is false from here on)
    props = node.get("properties", {})
    missing = {r: copy.deepcopy(schema) for r in [*node.get("required", []), *theirs]
               if isinstance(r, str) and r not in props}
    if missing:
        node["properties"] = {**props, **missing}
    node["patternProperties"] = {f"^(?:{not_in(frozenset(names))})$": schema}
    node["additionalProperties"] = False


def _char(c: str) -> str:
    return c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}"


@lru_cache(maxsize=256)
def not_in(names: frozenset[str]) -> str:
    """A regex (Rust syntax, unanchored) matching every string except the given ones: at each node of
    the names' trie, end here (where no name ends), or take a character no name continues with and
    then anything, or follow a child."""
    trie: dict[str, Any] = {}
    for name in names:
        node = trie
        for c in name:
            node = node.setdefault(c, {})
        node[""] = {}  # the end mark

    def at(node: dict[str, Any]) -> str:
        kids = sorted(k for k in node if k)
        alts = [] if "" in node else [""]
        alts.append(f"[^{''.join(_char(c) for c in kids)}](?s:.*)" if kids else "(?s:.+)")
        alts.extend(_char(c) + f"(?:{at(node[c])})" for c in kids)
        return "|".join(alts)

    return at(trie)


def _leap_seconds() -> str:
    """Every HH:MM with a ±hh:mm offset (and Z) at which a time is 23:59 UTC."""
    alts = ["23:59:60(?:\\.[0-9]+)?(?:[zZ]|[+-]00:00)"]
    by_local: dict[str, list[str]] = {}
    for sign in (1, -1):
        for off in range(1, 24 * 60):
            local = (23 * 60 + 59 + sign * off) % (24 * 60)
            key = f"{local // 60:02d}:{local % 60:02d}"
            by_local.setdefault(key, []).append(f"{'+' if sign > 0 else '-'}{off // 60:02d}:{off % 60:02d}")
    for local, offsets in sorted(by_local.items()):
        alts.append(f"{local}:60(?:\\.[0-9]+)?(?:{'|'.join(re.escape(o) for o in offsets)})")
    return "|".join(alts)


_OFFSET = "(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_TIME = f"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?{_OFFSET}|{_leap_seconds()}"
# years 0001-9999 (0000 is no year to Python's datetime), month lengths, 29 February in leap years
_YEAR = "(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29")
_DATE_TIME = f"(?:{_DATE})[tT](?:{_TIME})"
_FORMATS = {"time": _TIME, "date": _DATE, "date-time": _DATE_TIME}


_JSON = re.compile(r"%json\b\s*")
_DECODER = __import__("json").JSONDecoder()


def lark_json_bodies(text: str) -> list[tuple[int, int, Any]]:
    """The `%json <schema>` items of a Lark grammar: (start, end, schema) of each schema's JSON text, found
    outside string literals, regexes and comments, in order. A `%json` not followed by valid JSON is left to
    llguidance's parser to refuse."""
    out: list[tuple[int, int, Any]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or (c == "/" and not text.startswith("//", i)):
            # a string literal or a /regex/: skip to its unescaped closing quote or slash
            i += 1
            while i < n and text[i] != c and text[i] != "\n":
                i += 2 if text[i] == "\\" else 1
            i += 1
        elif text.startswith("//", i) or c == "#":
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif c == "%" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")) and _JSON.match(text, i):
            start = _JSON.match(text, i).end()  # type: ignore[union-attr]
            try:
                schema, end = _DECODER.raw_decode(text, start)
            except ValueError:
                i = start
                continue
            out.append((start, end, schema))
            i = end
        else:
            i += 1
    return out
