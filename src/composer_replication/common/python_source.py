"""Parsing Python source from several threads at once.

CPython 3.11 keeps the recursion depth of the AST object constructor in per-interpreter
state, so two threads that build ASTs at the same time can corrupt it and one of them fails
with ``SystemError: AST constructor recursion depth mismatch`` on valid code (CPython
gh-106905). Grading runs in worker threads and parses answers, so every parse goes through
one lock here; a parse takes microseconds to milliseconds, far below a test run.
"""

from __future__ import annotations

import ast
import threading

__all__ = ["parse_python"]

_PARSE_LOCK = threading.Lock()


def parse_python(source: str | bytes, mode: str = "exec") -> ast.AST:
    """``ast.parse(source, mode=mode)``, one thread at a time (``SyntaxError`` as there)."""
    with _PARSE_LOCK:
        return ast.parse(source, mode=mode)
