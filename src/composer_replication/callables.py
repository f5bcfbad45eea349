"""User code named by import path (``'package.module:name'``): custom advantages, the echo
filter, a custom rl loss, environment and inference-engine factories, algorithm classes."""

from __future__ import annotations

from typing import Any

__all__ = ["MissingName", "import_named", "load_callable"]


class MissingName(AttributeError):
    """The module imported but has no such name."""


def import_named(import_path: str) -> Any:
    """The object ``'package.module:name'`` names, its module imported now.

    Raises whatever importing the module raises (the user's module: any exception), and
    :class:`MissingName` when the module has no such name."""
    import importlib

    module_name, _, attr = import_path.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise MissingName(f"module {module_name!r} has no {attr!r}") from None


def load_callable(import_path: str, what: str) -> Any:
    """Import ``'package.module:function'``; errors name the path and what it was for."""
    try:
        fn = import_named(import_path)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"{what}: cannot import {import_path!r} ({type(exc).__name__}: {exc}); give "
            "'package.module:function' of an importable module"
        ) from exc
    if not callable(fn):
        raise ValueError(f"{what}: {import_path!r} is not callable")
    return fn
