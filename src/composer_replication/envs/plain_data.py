"""Plain data across the grading channel: exact built-in types <-> JSON, nothing else.

The trusted grader and the candidate's sandbox exchange call arguments and results through
this codec only. ``encode`` accepts exactly ``None``, ``bool``, ``int``, ``float``, ``str``,
``bytes``, ``list``, ``tuple``, ``dict``, ``set`` and ``frozenset`` (checked with ``type(x)
is ...``: subclasses, and so any object with a custom ``__eq__``, are refused), nested at
most ``MAX_DEPTH`` deep. ``decode`` rebuilds fresh objects of those types from JSON and
refuses anything else, so whatever the candidate writes, the grader compares built-in values
with built-in ``==``.

This file is copied into the sandbox next to the harness: it imports the standard library
only and nothing from the package.
"""

from __future__ import annotations

import base64
import math

MAX_DEPTH = 64

_SCALARS = (type(None), bool, int, str)


class PlainDataError(ValueError):
    """A value that is not plain data (its type is named in the message)."""


def encode(value: object, depth: int = 0) -> object:
    """A JSON-ready form of ``value``; containers and special floats are tagged."""
    if depth > MAX_DEPTH:
        raise PlainDataError(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is float:
        if math.isfinite(value):
            return value
        return {"$float": repr(value)}  # 'nan', 'inf', '-inf'
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"$tuple": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"$dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        tag = "$set" if kind is set else "$frozenset"
        return {tag: [encode(v, depth + 1) for v in value]}
    if kind is bytes:
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    raise PlainDataError(f"values of type {kind.__module__}.{kind.__qualname__} are not plain data")


def decode(data: object, depth: int = 0) -> object:
    """The value ``encode`` produced ``data`` from (fresh objects, built-in types only)."""
    if depth > MAX_DEPTH:
        raise PlainDataError(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(data)
    if kind in _SCALARS or kind is float:
        return data
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    if kind is not dict or len(data) != 1:
        raise PlainDataError(f"not an encoded value: {kind.__name__}")
    ((tag, body),) = data.items()
    if tag == "$float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$bytes" and type(body) is str:
        return base64.b64decode(body.encode("ascii"), validate=True)
    if type(body) is not list:
        raise PlainDataError(f"tag {tag!r} needs a list")
    items = [decode(v, depth + 1) for v in body]
    if tag == "$tuple":
        return tuple(items)
    if tag in ("$set", "$frozenset"):
        return (set if tag == "$set" else frozenset)(items)
    if tag == "$dict":
        out = {}
        for item in items:
            if type(item) is not list or len(item) != 2:
                raise PlainDataError("a $dict entry must be a [key, value] pair")
            try:
                out[item[0]] = item[1]
            except TypeError as err:  # an unhashable key
                raise PlainDataError(f"bad $dict key: {err}") from None
        return out
    raise PlainDataError(f"unknown tag {tag!r}")
