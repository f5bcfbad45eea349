"""The environment a repository's tasks are tested in, as task generation prepares it.

``prepare_environment`` picks what the repository's tests run with, once per repository:
a container image (``image``), the repository's own virtualenv (``sandbox.virtualenv``:
the repository installed from its work tree, its test dependencies, pytest and its
plugins), or the sandbox's interpreter (``environment = "system"``, or a repository that
declares no package and nothing its tests need). It returns the sandbox keywords every
gate and every later episode use (recorded on each task), the pytest options that load the
environment's plugins (part of the task's test command), and the built environment (whose
generated files a copy of the repository takes in).

Where the output folder is private to its user (a home directory of mode 0700, as for
root), the sandbox uid cannot reach a virtualenv beside the outputs: the environments then
live in the shared cache (``sandbox.workdir.shared_cache_dir``), said once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_replication.datagen.repository_copy import mark_output_folder
from composer_replication.sandbox.workdir import reachable_by_sandbox, shared_cache_dir

__all__ = ["ENVIRONMENTS", "TestEnvironment", "environments_path", "prepare_environment"]

#: how a repository's tests get what they need: a virtualenv when it declares a package or
#: test dependencies ("auto"), always ("venv"), or the sandbox's own interpreter ("system")
ENVIRONMENTS = ("auto", "venv", "system")


@dataclass(frozen=True)
class TestEnvironment:
    """What a repository's tests run with.

    Attributes:
        options: Keywords for the sandbox factory (``python``/``ro_binds`` or ``image``;
            empty: the sandbox's own interpreter).
        plugin_options: pytest options that load the environment's plugins (``-p NAME``).
        built: The virtualenv, when one was built or reused.
    """

    __test__ = False  # not a pytest test class

    options: dict[str, Any] = field(default_factory=dict)
    plugin_options: tuple[str, ...] = ()
    built: Any = None

    def test_command(self, command: str) -> str:
        """``command`` with the environment's plugins loaded (a pytest command only)."""
        if not self.plugin_options or "pytest" not in command:
            return command
        import shlex

        return f"{command} {shlex.join(self.plugin_options)}"

    def add_generated(self, workdir: Path) -> list[str]:
        """Copy what the repository's build generated into ``workdir`` (a copy of it)."""
        return self.built.add_generated(workdir) if self.built is not None else []


def environments_path(out: Path) -> Path:
    """Where a generation keeps the repositories' virtualenvs: ``<stem>.envs``."""
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.envs")


def prepare_environment(
    repo: Path,
    out: Path,
    environment: str,
    wheelhouse: str | os.PathLike[str] | None,
    image: str | None,
    say: Callable[[str], None],
) -> TestEnvironment:
    """The environment ``repo``'s tests run with (module docstring); ``out`` is the task
    file, beside which the virtualenvs live where the sandbox can reach them.

    Raises:
        RuntimeError: ``environment = "venv"`` and the virtualenv could not be built.
        ValueError: the shared cache a private output needs is unusable.
    """
    if image:
        say(f"environment: the container image {image}")
        return TestEnvironment({"image": image})
    if environment == "system":
        return TestEnvironment()
    from composer_replication.sandbox.virtualenv import (
        build_repo_environment,
        declares_dependencies,
    )

    if environment == "auto" and not declares_dependencies(repo):
        say("environment: the sandbox's interpreter (the repository declares no package)")
        return TestEnvironment()
    dest = environments_path(out)
    if not reachable_by_sandbox(dest):
        dest = shared_cache_dir("envs")
        say(
            f"environments: {dest} (the output folder {out.parent} is private: the sandbox's "
            "user cannot reach it)"
        )
    else:
        dest = mark_output_folder(dest)
    try:
        built = build_repo_environment(repo, dest, wheelhouse=wheelhouse, progress=say)
    except RuntimeError as err:
        if environment == "venv":
            raise
        say(f"environment: no virtualenv ({err}); the sandbox's interpreter runs the tests")
        return TestEnvironment()
    installed = built.project or "the repository not installed"
    say(f"environment: {built.root} ({installed}; {len(built.requirements)} distributions)")
    if built.note:
        say(f"environment: {built.note}")
    return TestEnvironment(built.sandbox_kwargs(), tuple(built.plugin_options()), built)
