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

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_KILL_SWITCH",
    "EXIT_NO_RESULT",
    "EXIT_OK",
    "EXIT_USAGE",
    "UsageError",
]

EXIT_OK = 0
EXIT_NO_RESULT = 1
EXIT_USAGE = 2
EXIT_KILL_SWITCH = 3
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
    """A user's mistake: the message is one line naming the value and the fix."""
