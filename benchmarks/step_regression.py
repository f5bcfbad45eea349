"""The main job's step time against an earlier revision of the project, side by side.

Run: ``python benchmarks/step_regression.py --baseline REV`` (default ``HEAD~1``). The
baseline is checked out into a temporary git worktree; both trees then run the same
``composer-replication train`` (the embedded default job unless ``--config``; no
evaluation, no checkpoint before the end, the same seed) for ``--steps`` steps, one after
the other in the same Python, alternating which goes first over ``--rounds`` rounds.
Printed: the median seconds per step of steps 2..N of each (the first step warms up), and
their ratio. The working tree's code is what this checkout holds (commit or not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, check_input, checked_output, machine_line, refuse, write_json

ROOT = Path(__file__).resolve().parents[1]


def resolve_revision(revision: str) -> str:
    """The commit ``revision`` names, or a one-line refusal."""
    found = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        refuse("--baseline", repr(revision), "no such revision here; give a commit, tag or branch")
    return found.stdout.strip()


def step_seconds(tree: Path, config: Path | None, steps: int, out: Path) -> list[float]:
    """``time/step_s`` of each step of the job run with ``tree``'s code."""
    command = [sys.executable, "-m", "composer_replication", "train"]
    if config is not None:
        command.append(str(config))
    for override in (
        f"steps={steps}",
        f"output_dir={out}",
        "eval.at_start=false",
        f"eval.every={steps + 1}",
        f"checkpoint.every={steps + 1}",
    ):
        command += ["--set", override]
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise SystemExit(f"the job failed with the code of {tree}:\n{tail}")
    rows = [json.loads(line) for line in next(out.rglob("metrics.jsonl")).read_text().splitlines()]
    return [r["time/step_s"] for r in rows if "time/step_s" in r]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD~1", help="the revision to compare with")
    parser.add_argument("--config", default=None, help="a run config (default: embedded job)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (>= 2)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each side")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    ns = parser.parse_args(argv)
    steps = check_count(ns.steps, "--steps", minimum=2, what="steps", why="the first warms up")
    rounds = check_count(ns.rounds, "--rounds", what="rounds")
    config = None if ns.config is None else check_input(ns.config, "--config").resolve()
    out = checked_output(ns.out, "--out")
    commit = resolve_revision(ns.baseline)
    print(machine_line(), flush=True)
    times: dict[str, list[float]] = {"baseline": [], "current": []}
    with tempfile.TemporaryDirectory() as scratch:
        baseline = Path(scratch) / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(baseline), commit],
            check=True,
            capture_output=True,
        )
        try:
            for k in range(rounds):
                order = ["baseline", "current"] if k % 2 == 0 else ["current", "baseline"]
                for side in order:
                    tree = baseline if side == "baseline" else ROOT
                    seconds = step_seconds(tree, config, steps, Path(scratch) / f"{side}-{k}")
                    times[side] += seconds[1:]
                    print(
                        f"round {k + 1} {side}: steps 2-{steps} "
                        + " ".join(f"{s:.1f}" for s in seconds[1:])
                        + " s",
                        flush=True,
                    )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)],
                capture_output=True,
            )
    medians = {side: statistics.median(values) for side, values in times.items()}
    ratio = medians["current"] / medians["baseline"]
    print(
        f"median s/step (steps 2-{steps}): baseline {commit[:10]} {medians['baseline']:.2f}, "
        f"current {medians['current']:.2f}: current / baseline = {ratio:.3f}",
        flush=True,
    )
    if out is not None:
        write_json(out, {"baseline": commit, "times": times, "medians": medians, "ratio": ratio})


if __name__ == "__main__":
    main()
