"""User functions named by import path (``'package.module:function'``): custom advantages,
the echo filter, a custom rl loss."""

from __future__ import annotations

from typing import Any

__all__ = ["load_callable"]


def load_callable(import_path: str, what: str) -> Any:
    """Import ``'package.module:function'``; errors name the path and what it was for."""
    import importlib

    module_name, _, attr = import_path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"{what}: cannot import {import_path!r} ({type(exc).__name__}: {exc}); give "
            "'package.module:function' of an importable module"
        ) from exc
    if not callable(fn):
        raise ValueError(f"{what}: {import_path!r} is not callable")
    return fn
