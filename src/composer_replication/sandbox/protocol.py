"""The ``Sandbox`` protocol every backend implements, and ``FakeSandbox`` (scripted, for
testing the components that drive a sandbox)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from composer_replication.sandbox.base import (
    SANDBOX_DENYLIST,
    CommandLog,
    TestRunResult,
    denied_message,
    is_command_allowed,
)

__all__ = ["SANDBOX_DENYLIST", "FakeSandbox", "Sandbox", "TestRunResult"]


@runtime_checkable
class Sandbox(Protocol):
    """What environments, gates and the hack monitor need from a sandbox backend."""

    def boot(self, image: str | None) -> None:
        """Start (or prepare) the environment; `image` names a container image if any."""
        ...

    def exec(self, action: dict[str, Any]) -> str:
        """Run `action["command"]`; return combined stdout/stderr (errors as text)."""
        ...

    def run_tests(self, test_command: str, tests: Sequence[str]) -> TestRunResult:
        """Run `test_command` on `tests` (node ids; empty = the whole suite)."""
        ...

    def trajectory(self) -> list[dict[str, Any]]:
        """Everything run so far, oldest first."""
        ...

    def is_command_allowed(self, command: str) -> bool:
        """First-token denylist policy (`SANDBOX_DENYLIST`)."""
        ...


TestScript = Callable[[str, Sequence[str]], TestRunResult]


class FakeSandbox(CommandLog):
    """A scripted sandbox: canned command outputs and test results, a real trajectory.

    Args:
        responses: Command -> output (exact match), or a function of the command.
        test_results: Results returned by successive `run_tests` calls (the last one
            repeats), or a function `(test_command, tests) -> TestRunResult`.
        default_output: Output for commands `responses` does not know.
        denylist: First-token denylist applied before looking up a response.
    """

    def __init__(
        self,
        responses: Mapping[str, str] | Callable[[str], str] | None = None,
        *,
        test_results: Iterable[TestRunResult] | TestScript | None = None,
        default_output: str = "",
        denylist: frozenset[str] = SANDBOX_DENYLIST,
    ) -> None:
        self._responses = responses if responses is not None else {}
        if test_results is None or callable(test_results):
            self._test_script: TestScript | None = test_results
            self._test_queue: list[TestRunResult] = []
        else:
            self._test_script = None
            self._test_queue = list(test_results)
        self._default_output = default_output
        self.denylist = denylist
        self.booted_image: str | None = None
        self._trajectory: list[dict[str, Any]] = []

    def boot(self, image: str | None = None) -> None:
        self.booted_image = image
        self._trajectory.append({"type": "boot", "image": image, "isolated": False})

    def exec(self, action: Mapping[str, Any]) -> str:
        command = action.get("command") if isinstance(action, Mapping) else None
        if not isinstance(command, str):
            raise ValueError(f"action must be a dict with a str 'command', got {action!r}")
        if not is_command_allowed(command, self.denylist):
            output = denied_message(command)
            allowed = False
        elif callable(self._responses):
            output, allowed = self._responses(command), True
        else:
            output, allowed = self._responses.get(command, self._default_output), True
        self._trajectory.append(
            {"type": "exec", "command": command, "allowed": allowed, "output": output}
        )
        return output

    def run_tests(
        self, test_command: str = "python -m pytest -q", tests: Sequence[str] = ()
    ) -> TestRunResult:
        if self._test_script is not None:
            result = self._test_script(test_command, list(tests))
        elif self._test_queue:
            result = self._test_queue.pop(0) if len(self._test_queue) > 1 else self._test_queue[0]
        else:
            raise RuntimeError(
                "FakeSandbox.run_tests has no scripted result; pass test_results= a list of "
                "TestRunResult or a function (test_command, tests) -> TestRunResult"
            )
        return self._record_tests(test_command, tests, result)
