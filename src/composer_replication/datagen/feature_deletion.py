"""FeatureDeletion (FD): tasks whose covered function bodies were deleted, from a repository.

The names of the task generator as first published here: ``generate_tasks`` (with
``kind="deletion"``, the default, it makes FeatureDeletion tasks; ``kind="bugs"`` bug-fix
tasks), its report, budgets and gate-5 solver live in ``datagen.generation``; the deletion
candidates and their prompt in ``datagen.deletions``; the records in ``envs.fd_tasks``.
"""

from __future__ import annotations

from composer_replication.datagen.gates import GateOutcome, SolvabilityValidator
from composer_replication.datagen.generation import (
    KINDS,
    NOT_REFERENCED,
    AgentBudgets,
    GenerationReport,
    ProgressCallback,
    ReferenceSolver,
    candidates_path,
    check_outputs,
    generate_tasks,
)
from composer_replication.datagen.repository_environment import ENVIRONMENTS, environments_path
from composer_replication.envs.fd_tasks import (
    Candidate,
    FDTask,
    TaskReference,
    apply_reference,
    find_candidates,
    output_paths,
)

__all__ = [
    "ENVIRONMENTS",
    "KINDS",
    "NOT_REFERENCED",
    "AgentBudgets",
    "Candidate",
    "FDTask",
    "GateOutcome",
    "GenerationReport",
    "ProgressCallback",
    "ReferenceSolver",
    "SolvabilityValidator",
    "TaskReference",
    "apply_reference",
    "candidates_path",
    "check_outputs",
    "environments_path",
    "find_candidates",
    "generate_tasks",
    "output_paths",
]
