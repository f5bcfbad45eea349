"""Digests of what an environment's evaluation reads: task records, files, and the name of
the function that builds its sandboxes. Environments name their held-out tasks with these
(``evaluation_digest``), so a kept start evaluation is reused only for the same tasks
(:mod:`composer_replication.evals.start_reuse`). Imports nothing of the project."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["digest_of_records", "grader_name"]


def grader_name(factory: Any) -> str | None:
    """``module.name`` of a module-level function that builds an environment's sandboxes, or
    None for anything whose behaviour its name does not fix (a closure, a lambda, a bound
    or partial object): such an environment's evaluations are not reused."""
    qualname = getattr(factory, "__qualname__", None)
    module = getattr(factory, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module, str) or "<" in qualname:
        return None
    if not hasattr(factory, "__code__"):
        return None
    return f"{module}.{qualname}"


def digest_of_records(records: Sequence[Any], files: Sequence[Path] = ()) -> str:
    """Digest of task records (dataclasses or JSON values) and of the bytes of ``files``
    (missing files digest as missing): what an environment's ``evaluation_digest`` returns."""
    h = hashlib.blake2b(digest_size=20)
    for record in records:
        value = dataclasses.asdict(record) if dataclasses.is_dataclass(record) else record
        h.update(json.dumps(value, sort_keys=True, default=str).encode())
    for path in files:
        h.update(str(path).encode())
        h.update(path.read_bytes() if path.is_file() else b"\0missing")
    return h.hexdigest()
