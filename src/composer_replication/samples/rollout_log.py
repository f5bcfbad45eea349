"""Rollouts saved as JSONL: what the policy did, turn by turn, for a person to read.

``RunConfig.save_rollouts`` ("none", "eval", "all") decides which: evaluation rollouts go to
``<run>/rollouts/eval_step_<step>.jsonl`` (the step in four digits: ``eval_step_0000`` is
the initial policy), training rollouts to ``<run>/rollouts/train_step_<step>.jsonl`` (under
data parallelism, rank 0's share of the step). One row per rollout: the task, its reward,
error and feedback, its token counts, the decoded completion, and the environment's
metadata (an agent episode's conversation, its events with their turns, its end reason, the
hack monitor's verdict). Each file is written atomically.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["rollout_rows", "write_rollouts"]


def rollout_rows(rollouts: Iterable[Any], tokenizer: Any) -> list[dict[str, Any]]:
    """One JSON-able row per rollout (see the module docstring); without a tokenizer the
    completion is not decoded (None)."""
    rows = []
    for r in rollouts:
        rows.append(
            {
                "task_id": r.task_id,
                "reward": float(r.reward),
                "error": r.error,
                "feedback": r.feedback,
                "prompt_tokens": len(r.prompt_ids),
                "completion_tokens": len(r.completion_ids),
                "sampled_tokens": r.n_sampled_tokens,
                "completion": None
                if tokenizer is None
                else tokenizer.decode(r.completion_ids, skip_special_tokens=False),
                "metadata": r.metadata,
            }
        )
    return rows


def write_rollouts(path: Path, rollouts: Iterable[Any], tokenizer: Any) -> Path:
    """Write ``rollouts`` to ``path`` as JSONL (atomically; values JSON cannot hold become
    their text)."""
    from composer_replication.common.atomic_io import write_lines_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (
        json.dumps(row, sort_keys=True, default=str) + "\n"
        for row in rollout_rows(rollouts, tokenizer)
    )
    write_lines_atomic(path, lines)
    return path
