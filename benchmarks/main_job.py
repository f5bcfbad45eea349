"""What the main job does to the model: whole ``composer-replication train`` commands, timed.

Three studies, each a subcommand:

- ``seeds``: one run config (default: the embedded default job) over several seeds, with
  greedy held-out pass@1 measured before and after (``--no-greedy``: the config's own
  evaluation only); ``--humaneval`` also grades the base model and every final model on
  HumanEval (greedy pass@1);
- ``ablation``: the recipe against each of its channels alone (grpo, sdpo, replay_dpo, ...)
  under one time budget (``max_wall_seconds``), everything else as in the default job;
- ``plot``: curves (held-out pass@1 sampled and greedy, and the in-loop reward, per step)
  of every run under an output directory, as one PNG.

Every run writes its own directory under ``--out``; a run whose ``summary.json`` exists is
read back instead of rerun, and ``results.json`` is rewritten atomically after each run,
so an interrupted study resumes where it stopped. Runs are sequential: on a small machine
two runs at once would time each other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import (
    check_count,
    check_input,
    check_number,
    check_seconds,
    checked_output,
    refuse,
)

CLI = [sys.executable, "-m", "composer_replication"]
SCORES = ("heldout/pass@1", "heldout/greedy_pass@1", "heldout/pass@4")


def _write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def before_after(rows: list[dict[str, Any]], key: str) -> tuple[float | None, float | None]:
    """The first and the last evaluation's value of ``key`` (None where never measured)."""
    seen = [r[key] for r in rows if r.get(key) is not None]
    return (seen[0], seen[-1]) if seen else (None, None)


def run_summary(run_dir: Path, seconds: float | None) -> dict[str, Any]:
    rows = metric_rows(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "steps": summary["steps"],
        "command_seconds": seconds,
        "run_wall_seconds": summary["wall_time_s"],
        "reward_first_steps": sum(rewards[:3]) / max(1, len(rewards[:3])),
        "reward_last_steps": sum(rewards[-3:]) / max(1, len(rewards[-3:])),
    }
    for key in SCORES:
        out[key] = before_after(rows, key)
    return out


def train(config: str | None, run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """One whole ``train`` command (unless its summary exists), timed from the outside."""
    if (run_dir / "summary.json").exists():
        return run_summary(run_dir, None)
    cmd = [*CLI, "train", *([config] if config else []), "--output-dir", str(run_dir)]
    for item in overrides:
        cmd += ["--set", item]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 3):  # 3: the kill switch stopped the run (still a result)
        raise SystemExit(f"train exited {proc.returncode}: {' '.join(cmd)}")
    return run_summary(run_dir, seconds)


def humaneval(model: str, out: Path) -> float:
    """Greedy HumanEval pass@1 of ``model`` (cached in ``out``)."""
    if not out.exists():
        cmd = [*CLI, "eval", model, "--suite", "humaneval", "-o", str(out)]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return json.loads(out.read_text())["greedy"]["pass@1"]


def _fmt(pair: tuple[float | None, float | None]) -> str:
    a, b = pair
    if a is None or b is None:
        return "n/a"
    return f"{a:.3f} -> {b:.3f} ({100 * (b - a):+.1f} pts)"


def print_table(results: dict[str, Any]) -> None:
    for name, r in results["runs"].items():
        took = r["command_seconds"]
        print(
            f"{name}: {r['steps']} steps, command {took:.0f} s" if took else f"{name}: cached",
            f"| greedy {_fmt(r['heldout/greedy_pass@1'])} | pass@1 {_fmt(r['heldout/pass@1'])}"
            f" | pass@4 {_fmt(r['heldout/pass@4'])}"
            + (f" | HumanEval {r['humaneval']:.3f}" if "humaneval" in r else ""),
        )
    for label, key in (("greedy", "heldout/greedy_pass@1"), ("pass@1", "heldout/pass@1")):
        gains = [r[key][1] - r[key][0] for r in results["runs"].values() if None not in r[key]]
        if gains:  # the greedy rate where measured, else the config's own pass@1
            print(
                f"{label} gain: mean {100 * sum(gains) / len(gains):+.1f} pts,"
                f" min {100 * min(gains):+.1f} pts over {len(gains)} runs"
            )
            break
    if "humaneval_base" in results:
        print(f"HumanEval base {results['humaneval_base']:.3f}")


def cmd_seeds(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    results_path = out / "results.json"
    results: dict[str, Any] = {"study": "seeds", "config": args.config, "runs": {}}
    if args.humaneval:
        results["humaneval_base"] = humaneval("embedded", out / "humaneval_base.json")
    for seed in args.seeds:
        run_dir = out / f"seed_{seed}"
        greedy = ["eval.greedy=true"] if args.greedy else []
        found = train(args.config, run_dir, [f"seed={seed}", *greedy, *args.set])
        if args.humaneval:
            found["humaneval"] = humaneval(
                str(run_dir / "final_model"), out / f"humaneval_seed_{seed}.json"
            )
        results["runs"][f"seed_{seed}"] = found
        _write_json_atomic(results_path, results)
    return results


def cmd_ablation(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    results_path = out / "results.json"
    results: dict[str, Any] = {
        "study": "ablation",
        "max_wall_seconds": args.seconds,
        "runs": {},
    }
    for algorithm in args.algorithms:
        config = out / f"{algorithm}.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(ablation_config(algorithm, args.seconds, args.seed))
        found = train(str(config), out / algorithm, list(args.set))
        results["runs"][algorithm] = found
        _write_json_atomic(results_path, results)
    return results


def ablation_config(algorithm: str, seconds: float, seed: int) -> str:
    """The default job with ``algorithm`` in place of composer (its own vetted settings),
    stopped by the time budget rather than the step count. The learning rate is constant:
    a schedule over ``steps`` would decay at a different pace for each algorithm, whose
    steps take different times."""
    from composer_replication.config import RunConfig
    from composer_replication.config.toml_writer import dumps

    data = RunConfig.default().model_dump(mode="json", exclude_none=True)
    data.update(seed=seed, steps=10_000, max_wall_seconds=seconds)
    data["eval"].update(greedy=True, every=10_000)
    data["optim"]["schedule"] = "constant"
    env = data["envs"][0]
    env["algorithm"]["advantage"] = {"type": algorithm}
    # the default's loss settings were resolved for composer: let the new algorithm's apply
    data.pop("loss", None)
    RunConfig.model_validate(data)  # fail here, not after minutes of other runs
    return dumps(data)


def check_algorithms(algorithms: list[str], seconds: float, seed: int) -> None:
    """Every algorithm of an ablation makes a valid run of the default job, before any run
    (one that does not would otherwise stop the study after minutes of the others)."""
    from pydantic import ValidationError

    from composer_replication.config.advantage import BUILTIN_ADVANTAGES

    known = list(BUILTIN_ADVANTAGES)
    for algorithm in algorithms:
        if algorithm not in known:
            refuse("--algorithms", repr(algorithm), f"use some of {', '.join(known)}")
        try:
            ablation_config(algorithm, seconds, seed)
        except ValidationError as err:
            first = err.errors()[0]
            reason = first["msg"].removeprefix("Value error, ")
            if first["type"] != "value_error":  # a missing or wrong field: name it
                reason = f"{'.'.join(map(str, first['loc']))}: {reason}"
            refuse("--algorithms", repr(algorithm), f"the default job cannot run it: {reason}")


PANELS = {
    "greedy": ("heldout/greedy_pass@1", "held-out greedy pass@1"),
    "sampled": ("heldout/pass@1", "held-out sampled pass@1 (T=1)"),
    "reward": ("reward/mean", "in-loop reward (mean of the step)"),
}


def cmd_plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    run_dirs = sorted(p.parent for p in out.glob("*/summary.json"))
    if not run_dirs:
        raise SystemExit(f"no finished runs (summary.json) under {out}")
    panels = [PANELS[name] for name in args.panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    axes = axes[0]
    for ax, (key, title) in zip(axes, panels):
        if key == "heldout/greedy_pass@1" and args.base_greedy is not None:
            ax.axhline(args.base_greedy, color="gray", ls="--", lw=1, label="base model")
        for run_dir in run_dirs:
            rows = [r for r in metric_rows(run_dir) if r.get(key) is not None]
            ax.plot(
                [r["step"] for r in rows],
                [r[key] for r in rows],
                marker="o",
                ms=3,
                label=run_dir.name,
            )
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(args.title or str(out))
    fig.tight_layout()
    target = Path(args.png or out / "curves.png")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial.png")
    fig.savefig(partial, dpi=110)
    os.replace(partial, target)  # the old plot or the new one, never half
    print(f"wrote {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="study", required=True)
    seeds = sub.add_parser("seeds", help="one config over several seeds")
    seeds.add_argument("--config", default=None, help="run config TOML (default: embedded)")
    seeds.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    seeds.add_argument("--humaneval", action="store_true", help="also grade HumanEval")
    seeds.add_argument(
        "--no-greedy",
        dest="greedy",
        action="store_false",
        help="evaluate as the config says (no greedy answers added: an agent config that "
        "evaluates at temperature 0 reports its greedy rate as pass@1)",
    )
    seeds.add_argument("--set", action="append", default=[], help="config override")
    seeds.add_argument("--out", default="runs/bench/seeds")
    ablation = sub.add_parser("ablation", help="the recipe vs its channels, equal wall time")
    ablation.add_argument(
        "--algorithms", nargs="+", default=["composer", "grpo", "sdpo", "replay_dpo"]
    )
    ablation.add_argument("--seconds", type=float, default=420.0, help="max_wall_seconds")
    ablation.add_argument("--seed", type=int, default=0)
    ablation.add_argument("--set", action="append", default=[], help="config override")
    ablation.add_argument("--out", default="runs/bench/ablation")
    plot = sub.add_parser("plot", help="curves of every run under --out")
    plot.add_argument("--out", required=True)
    plot.add_argument("--png", default=None)
    plot.add_argument("--title", default=None)
    plot.add_argument("--panels", nargs="+", choices=sorted(PANELS), default=list(PANELS))
    plot.add_argument(
        "--base-greedy", type=float, default=None, help="draw the base model's greedy pass@1"
    )
    args = parser.parse_args()
    if args.study == "plot":
        check_input(args.out, "--out", directory=True)  # the runs it draws
        if args.base_greedy is not None:
            check_number(args.base_greedy, "--base-greedy", maximum=1.0, what="a pass@1")
        args.png = checked_output(args.png or Path(args.out) / "curves.png", "--png")
    else:
        if args.study == "seeds":
            if args.config is not None:
                check_input(args.config, "--config")
            for seed in args.seeds:
                check_count(seed, "--seeds", minimum=0, what="seeds")
        else:
            check_seconds(args.seconds, "--seconds")
            check_count(args.seed, "--seed", minimum=0, what="a seed")
            check_algorithms(args.algorithms, args.seconds, args.seed)
        checked_output(args.out, "--out", directory=True)
    if args.study == "plot":
        cmd_plot(args)
        return
    results = cmd_seeds(args) if args.study == "seeds" else cmd_ablation(args)
    print_table(results)


if __name__ == "__main__":
    main()
