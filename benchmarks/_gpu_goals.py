"""The pure parts of ``benchmarks/gpu.py``: GPU busy from kernel intervals, seeded synthetic
rewards for random-weight runs, and the goals table read from a result dict.

Nothing here imports torch or touches a device, so every function is checked on the CPU
(``tests/test_benchmark_gpu.py``) with hand-made inputs.
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# --------------------------------------------------------------------------- GPU busy


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of the closed intervals ``[start, end]`` (any order, overlapping,
    nested or touching; an empty one adds nothing).

    A GPU runs kernels from several streams at once, so summing kernel durations can
    exceed the wall time; their union cannot.

    Raises:
        ValueError: an interval ends before it starts, or is not finite.
    """
    spans = []
    for start, end in intervals:
        if not (math.isfinite(start) and math.isfinite(end)):
            raise ValueError(f"interval ({start}, {end}) is not finite")
        if end < start:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
        spans.append((start, end))
    spans.sort()
    covered, reach = 0.0, -math.inf
    for start, end in spans:
        if end <= reach:
            continue  # inside what is already covered
        covered += end - max(start, reach)
        reach = end
    return covered


def busy_share(intervals: Iterable[tuple[float, float]], wall: float) -> float:
    """Share of ``wall`` (the measured region's wall time, in the intervals' unit) during
    which at least one interval (a kernel) ran."""
    if not (math.isfinite(wall) and wall > 0):
        raise ValueError(f"wall time {wall}: give the measured region's duration, > 0")
    return union_length(intervals) / wall


# --------------------------------------------------------------------------- rewards


def synthetic_reward(seed: int, task_id: str, row: int, completion_ids: Sequence[int]) -> float:
    """A reward in [0, 1) for one rollout of a random-weight run: the first 8 bytes of a
    BLAKE2b hash of the seed, the task, the row's place in its group and its completion
    tokens, as a fraction of 2**64. The same inputs give the same reward in every process
    (Python's ``hash`` of a string would not)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(struct.pack("<qq", seed, row))
    digest.update(task_id.encode())
    digest.update(struct.pack(f"<{len(completion_ids)}q", *completion_ids))
    return int.from_bytes(digest.digest(), "little") / 2**64


def synthetic_group_rewards(
    seed: int, task_id: str, completions: Sequence[Sequence[int]]
) -> list[float]:
    """One :func:`synthetic_reward` per completion of a group. A group of two or more
    always has two different rewards, so its group-relative advantages are not all zero
    and every loss component that reads them trains: in the (astronomically unlikely)
    case that all hashes agree, the first reward is mirrored to ``1 - r``."""
    rewards = [synthetic_reward(seed, task_id, i, ids) for i, ids in enumerate(completions)]
    if len(rewards) > 1 and len(set(rewards)) == 1:
        rewards[0] = 1.0 - rewards[0] if rewards[0] != 0.5 else 0.0
    return rewards


# --------------------------------------------------------------------------- budgets


class PartBudget:
    """Seconds one part of a run may take: started when made, asked before each extra
    repeat. The part's first measured repeat always runs; the budget limits the rest."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = seconds
        self.clock = clock
        self.start = clock()

    def used(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.seconds - self.used()

    def allows(self, next_cost: float) -> bool:
        """Whether one more repeat expected to take ``next_cost`` seconds still fits."""
        return self.used() + next_cost <= self.seconds


# --------------------------------------------------------------------------- goals

MET, NOT_MET = "met", "not met"
NOT_MEASURED = "not measured"
UNAVAILABLE = "not available in this build"

#: the card the memory goal is about: 80 GB, 10% of it kept spare
CARD_BYTES = 80e9
SPARE = 0.10


class _Missing(Exception):
    """The result dict lacks what a goal reads (the part was skipped, failed or ran out
    of budget); the message says which."""


class _Unavailable(Exception):
    """The build cannot run what the goal measures (the message says why)."""


@dataclass(frozen=True)
class Goal:
    """One row of the goals table: ``measure(results) -> (value, shown, detail)`` and
    whether ``value`` meets ``target`` (``at_least``: value >= target, else <=)."""

    key: str
    goal: str
    target_text: str
    target: float
    at_least: bool
    measure: Callable[[dict[str, Any]], tuple[float, str, str]]

    def met(self, value: float) -> bool:
        return value >= self.target if self.at_least else value <= self.target


def _entry(results: dict[str, Any], *path: str) -> dict[str, Any]:
    """``results[path[0]][path[1]]...``; ``_Missing``/``_Unavailable`` when absent, an
    error, or marked unavailable."""
    node: Any = results
    for i, key in enumerate(path):
        if not isinstance(node, dict) or key not in node:
            raise _Missing(f"no {'.'.join(path[: i + 1])} in the results")
        node = node[key]
        if isinstance(node, dict) and "unavailable" in node:
            raise _Unavailable(node["unavailable"])
        if isinstance(node, dict) and "error" in node:
            raise _Missing(f"{'.'.join(path[: i + 1])} failed: {node['error']}")
    return node


def _number(entry: dict[str, Any], key: str, where: str) -> float:
    value = entry.get(key)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Missing(f"{where}.{key} is {value!r}")
    return float(value)


def _gpu_busy(results: dict[str, Any]) -> tuple[float, str, str]:
    step = _entry(results, "steps", "composer", "async_0")
    busy = _number(step, "gpu_busy_kernels", "steps.composer.async_0")
    nvml = step.get("gpu_busy_nvml")
    nvml_text = f"{nvml:.0%}" if isinstance(nvml, (int, float)) else "n/a"
    return busy, f"{busy:.0%}", f"NVML utilisation over the same step: {nvml_text}"


def _async_overlap(results: dict[str, Any]) -> tuple[float, str, str]:
    sync = _entry(results, "steps", "composer", "async_0")
    ahead = _entry(results, "steps", "composer", "async_1")
    sample_grade = _number(sync, "sample_s", "async_0") + _number(sync, "grade_score_s", "async_0")
    train = _number(sync, "train_s", "async_0")
    step = _number(ahead, "step_s", "async_1")
    bound = max(sample_grade, train)
    if bound <= 0:
        raise _Missing("async_0's phases took no time")
    return (
        step / bound,
        f"{step / bound:.2f}x",
        f"step {step:.2f} s at async_level 1; sample + grade {sample_grade:.2f} s, "
        f"train {train:.2f} s at async_level 0",
    )


def _rl_learner(results: dict[str, Any]) -> tuple[float, str, str]:
    rl = _number(_entry(results, "train", "rl"), "tokens_s", "train.rl")
    plain = _number(_entry(results, "train", "plain"), "tokens_s", "train.plain")
    return rl / plain, f"{rl / plain:.2f}x", f"{rl:,.0f} vs {plain:,.0f} tokens/s"


def _composer_learner(results: dict[str, Any]) -> tuple[float, str, str]:
    composer = _entry(results, "train", "composer")
    value = _number(composer, "tokens_s", "train.composer")
    rl = _number(_entry(results, "train", "rl"), "tokens_s", "train.rl")
    parts = composer.get("component_tokens") or {}
    trained = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(parts.items()) if v or k == "rl")
    return (
        value / rl,
        f"{value / rl:.0%}",
        f"{value:,.0f} vs {rl:,.0f} tokens/s; tokens per component: {trained or 'n/a'}",
    )


def _sampling(results: dict[str, Any]) -> tuple[float, str, str]:
    sampling = _entry(results, "sampling")
    batch = sampling.get("goal_batch", 64)
    entry = _entry(results, "sampling", f"batch_{batch}")
    ours = _number(_entry(entry, "static_graphs"), "tokens_s", "static_graphs")
    hf = _number(_entry(entry, "hf"), "tokens_s", "hf")
    return ours / hf, f"{ours / hf:.1f}x", f"batch {batch}: {ours:,.0f} vs {hf:,.0f} tokens/s"


def _memory(results: dict[str, Any]) -> tuple[float, str, str]:
    memory = _entry(results, "memory")
    peaks = {k: v for k, v in memory.get("peak_bytes", {}).items() if isinstance(v, int | float)}
    if not peaks:
        raise _Missing("no peak memory recorded (a CPU run reports None)")
    peak = max(peaks.values())
    spare = 1 - peak / CARD_BYTES
    where = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.items())
    return spare, f"{peak / 1e9:.1f} GB ({spare:.0%} spare)", f"peak GB per phase: {where}"


GOALS: tuple[Goal, ...] = (
    Goal("gpu_busy", "composer step: GPU busy (kernel union)", ">= 60%", 0.60, True, _gpu_busy),
    Goal(
        "async_overlap",
        "step at async_level = 1 vs max(sample + grade, train)",
        "<= 1.15x",
        1.15,
        False,
        _async_overlap,
    ),
    Goal(
        "rl_learner",
        "rl-only learner vs plain forward + backward + fused AdamW",
        ">= 1.05x",
        1.05,
        True,
        _rl_learner,
    ),
    Goal(
        "composer_learner",
        "composer learner (all components) vs rl-only learner",
        ">= 50%",
        0.50,
        True,
        _composer_learner,
    ),
    Goal(
        "sampling", "sampling at batch 64 vs transformers generate", ">= 10x", 10.0, True, _sampling
    ),
    Goal(
        "memory",
        "peak memory within 80 GB",
        ">= 10% spare",
        SPARE,
        True,
        _memory,
    ),
)


def evaluate_goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per goal: ``key``, ``goal``, ``target``, ``value`` (None when not
    measured), ``shown``, ``detail``, ``measured`` and ``status`` (met / not met, or why
    there is no verdict). ``results["measured"]`` false (a CPU or ``--quick`` run, whose
    ``results["dry_run"]`` says which) keeps every verdict out: the values are shown, the
    status says they were not measured."""
    measured = bool(results.get("measured"))
    dry_run = results.get("dry_run", "on CPU")
    rows = []
    for goal in GOALS:
        row: dict[str, Any] = {
            "key": goal.key,
            "goal": goal.goal,
            "target": goal.target_text,
            "value": None,
            "shown": "-",
            "detail": "",
            "measured": False,
        }
        try:
            value, shown, detail = goal.measure(results)
        except _Unavailable as why:
            row.update(status=UNAVAILABLE, detail=str(why))
        except _Missing as why:
            status = NOT_MEASURED if measured else f"{NOT_MEASURED} {dry_run}"
            row.update(status=status, detail=str(why))
        else:
            row.update(value=value, shown=shown, detail=detail)
            if measured:
                row.update(measured=True, status=MET if goal.met(value) else NOT_MET)
            else:
                row.update(status=f"{NOT_MEASURED} {dry_run} (dry run: {shown})")
        rows.append(row)
    return rows


def goals_table(rows: Sequence[dict[str, Any]]) -> str:
    """The goal rows as a markdown table."""
    lines = ["| goal | target | result | status | detail |", "|---|---|---|---|---|"]
    for r in rows:
        result = r["shown"] if r["measured"] else "-"
        detail = r["detail"].replace("|", "/")
        lines.append(f"| {r['goal']} | {r['target']} | {result} | {r['status']} | {detail} |")
    return "\n".join(lines)
