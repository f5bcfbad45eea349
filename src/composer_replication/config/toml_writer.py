"""A small TOML writer for configs (tomllib reads TOML but cannot write it).

Covers what pydantic's ``model_dump(mode="json")`` produces: tables, strings, booleans,
integers, floats (inf / nan included), arrays, and tables nested inside arrays (written
inline). ``None`` values are left out: TOML has no null, and every optional field defaults
to None, so reading the file back gives the same config.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _string(key)


def _string(value: str) -> str:
    out = []
    for ch in value:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value if v is not None) + "]"
    if isinstance(value, Mapping):
        items = [f"{_key(str(k))} = {_value(v)}" for k, v in value.items() if v is not None]
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} to TOML")


def dumps(data: Mapping[str, Any]) -> str:
    """TOML text for a mapping: scalars first, then one ``[a.b]`` section per sub-table."""
    lines: list[str] = []
    _table(data, [], lines)
    return "\n".join(lines).strip() + "\n"


def _table(data: Mapping[str, Any], path: list[str], lines: list[str]) -> None:
    scalars = [(k, v) for k, v in data.items() if v is not None and not isinstance(v, Mapping)]
    tables = [(k, v) for k, v in data.items() if isinstance(v, Mapping)]
    if path and (scalars or not tables):
        lines.append("")
        lines.append("[" + ".".join(_key(p) for p in path) + "]")
    for key, value in scalars:
        lines.append(f"{_key(str(key))} = {_value(value)}")
    for key, value in tables:
        _table(value, [*path, str(key)], lines)


def dumps_array_of_tables(path: list[str], items: list[Mapping[str, Any]]) -> str:
    """TOML text of an array of tables: one ``[[a.b]]`` section per item, its sub-tables as
    ``[a.b.key]`` sections below it (valid after any other sections of a document)."""
    lines: list[str] = []
    header = "[[" + ".".join(_key(p) for p in path) + "]]"
    for item in items:
        lines.append("")
        lines.append(header)
        for key, value in item.items():
            if value is not None and not isinstance(value, Mapping):
                lines.append(f"{_key(str(key))} = {_value(value)}")
        for key, value in item.items():
            if isinstance(value, Mapping):
                _table(value, [*path, str(key)], lines)
    return "\n".join(lines).strip() + "\n"
