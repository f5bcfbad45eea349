"""Sampling ahead in process: the same job with ``[inference] async_level = 0`` and ``= 1``
(the in-process engine), side by side in one run.

Run: ``python benchmarks/sample_ahead.py`` (the embedded default job, 5 steps per side:
about 4 minutes on 2 CPU cores; ``--config`` any run config, ``--steps``, ``--out`` a JSON).

Printed per side: the median seconds per step after the first, and for the synchronous side
its two phases (sample + grade: ``time/generate_score_s``; train: ``time/train_s``). The goal
of sampling ahead is a step no longer than about the slower phase: printed is the one-ahead
step over ``max(sample + grade, train)`` of the synchronous run (1.0 is perfect overlap, the
synchronous step is the sum of both), and the speed-up of the one-ahead job. On a CPU the
two phases share the cores, so the overlap there is partial; on a GPU the sampler has its
own CUDA stream (``benchmarks/gpu.py --all`` measures it there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, check_input, checked_output, machine_line, write_json


def run_side(config_path: Path | None, steps: int, level: int) -> dict[str, Any]:
    """One side: ``steps`` steps of the job with ``async_level = level``; medians of the
    steps after the first."""
    from composer_replication.config.run import RunConfig
    from composer_replication.training.loop import train

    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"steps={steps}",
            f"output_dir={out}",
            "eval.at_start=false",
            f"eval.every={steps + 1}",
            f"checkpoint.every={steps + 1}",
            f"inference.async_level={level}",
        ]
        if config_path is None:
            config = RunConfig.default(overrides)
        else:
            config = RunConfig.from_toml(config_path, overrides)
        result = train(config)
    rows = [r for r in result.metrics if "time/step_s" in r][1:]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    return {
        "async_level": level,
        "step_s": median("time/step_s"),
        "sample_grade_s": median("time/generate_score_s"),
        "train_s": median("time/train_s"),
        "wait_rollouts_s": median("time/wait_rollouts_s"),
        "staleness_mean": median("async/staleness_mean"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="a run config (default: the embedded job)")
    parser.add_argument("--steps", type=int, default=5, help="steps per side (>= 2)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    ns = parser.parse_args(argv)
    config = None if ns.config is None else check_input(ns.config, "--config")
    steps = check_count(ns.steps, "--steps", minimum=2, what="steps", why="the first is warm-up")
    out = checked_output(ns.out, "--out")
    print(machine_line(), flush=True)
    sides = {}
    for level in (0, 1):
        side = sides[level] = run_side(config, steps, level)
        print(
            f"async_level={level}: {side['step_s']:.1f} s/step (median of steps 2-{steps}); "
            f"sample+grade {side['sample_grade_s']:.1f} s, train {side['train_s']:.1f} s, "
            f"waited for rollouts {side['wait_rollouts_s']:.1f} s, staleness "
            f"{side['staleness_mean']:.1f}",
            flush=True,
        )
    sync, ahead = sides[0], sides[1]
    bound = max(sync["sample_grade_s"], sync["train_s"])
    result = {
        "sides": sides,
        "ahead_over_slower_phase": ahead["step_s"] / bound if bound else None,
        "speedup": sync["step_s"] / ahead["step_s"] if ahead["step_s"] else None,
    }
    print(
        f"one ahead: {result['ahead_over_slower_phase']:.2f} x max(sample + grade, train) of "
        f"the synchronous step (goal <= 1.15 on a GPU); {result['speedup']:.2f}x steps/s "
        "vs synchronous",
        flush=True,
    )
    if out is not None:
        write_json(out, result)


if __name__ == "__main__":
    main()
