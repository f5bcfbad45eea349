"""The exit codes every command uses, and the error a user's mistake raises.

=====  =================================================================================
0      success
1      nothing produced: the input held nothing usable, or every unit of work failed
       (previous outputs are left in place)
2      a usage error: a bad option, config value, path or model (one line on stderr
       naming the value and the fix; ``--debug`` shows the traceback where a command has it)
3      the held-out kill switch stopped a training run
130    interrupted (Ctrl-C); ``train`` prints where its last checkpoint is
=====  =================================================================================
"""

from __future__ import annotations

import difflib
import errno
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_KILL_SWITCH",
    "EXIT_NO_RESULT",
    "EXIT_OK",
    "EXIT_USAGE",
    "UsageError",
    "command_group",
    "did_you_mean",
    "shortened",
    "user_error",
]

EXIT_OK = 0
EXIT_NO_RESULT = 1
EXIT_USAGE = 2
EXIT_KILL_SWITCH = 3
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
    """A user's mistake: the message is one line naming the value and the fix."""


def user_error(exc: BaseException) -> str:
    """One line for a user's mistake: a config value and what is valid, a missing file."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors()[:3]:
            where = ".".join(str(p) for p in err.get("loc", ()))
            message = str(err.get("msg", "")).removeprefix("Value error, ")
            value = err.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            parts.append(f"{where}: {message}{shown}" if where else message)
        more = len(exc.errors()) - 3
        return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
    if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG and exc.filename:
        name = str(exc.filename)
        longest = max(len(part) for part in name.split("/"))
        return (
            f"path too long ({len(name.encode())} bytes, a name of {longest} characters; this "
            f"system allows {os.pathconf('/', 'PC_PATH_MAX')} bytes and names of "
            f"{os.pathconf('/', 'PC_NAME_MAX')}): {shortened(name)}"
        )
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text


def did_you_mean(value: str, choices: tuple[str, ...] | list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to ``value``; "" if none is close."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def shortened(text: str, keep: int = 60) -> str:
    """``text`` with its middle elided when longer than ``2 * keep`` characters."""
    return text if len(text) <= 2 * keep else f"{text[:keep]}...{text[-keep:]}"


def command_group(name: str, help: str, **settings: Any) -> typer.Typer:
    """A Typer app as every command group of this package is built: plain error output (no
    rich traceback boxes), its help when called with no command, no shell-completion
    options; ``settings`` go to ``typer.Typer`` as well (``cls=...``)."""
    import typer

    return typer.Typer(
        name=name,
        help=help,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        **settings,
    )


def user_code_error(what: str, err: BaseException, call: str) -> UsageError:
    """One line blaming user code: ``what`` (e.g. ``loss.import_path = 'm:f'``) raised
    ``err`` (its type and first line) when called as ``call``."""
    first = str(err).splitlines()[0] if str(err) else ""
    return UsageError(f"{what} raised {type(err).__name__}: {first} ({call})")
