"""User code named by import path (``'package.module:name'``): custom advantages, the echo
filter, a custom rl loss, environment and inference-engine factories, algorithm classes."""

from __future__ import annotations

from typing import Any

__all__ = ["MissingName", "import_named", "last_line", "load_callable"]


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


def last_line(err: BaseException) -> str:
    """An exception's type and the last line of its message (where Python puts the cause)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1].strip()}" if lines else type(err).__name__


def load_callable(import_path: str, what: str) -> Any:
    """Import ``'package.module:function'``; errors name what it was for (the setting), the
    path and the error's last line, whatever the user's module raised while importing."""
    module_name = import_path.partition(":")[0]
    try:
        fn = import_named(import_path)
    except MissingName as exc:
        raise ValueError(
            f"{what}: {exc}; give 'package.module:function' of a name the module defines"
        ) from exc
    except ImportError as exc:
        raise ValueError(
            f"{what}: cannot import {import_path!r} ({last_line(exc)}); give "
            "'package.module:function' of an importable module"
        ) from exc
    except Exception as exc:  # the user's module failed while it imported: name it
        raise ValueError(
            f"{what}: module {module_name!r} of {import_path!r} fails at import "
            f"({last_line(exc)}); fix the module"
        ) from exc
    if not callable(fn):
        raise ValueError(f"{what}: {import_path!r} is not callable")
    return fn
