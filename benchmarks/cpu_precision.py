"""The CPU path in bfloat16 against float32, side by side in one run (ratios printed).

On a CPU that computes bfloat16 matrix products (AMX or AVX512-BF16) ``model.dtype = "auto"``
trains under bfloat16 autocast over float32 master weights; its rollouts are sampled on a
bfloat16 copy of the weights (``[inference] sampling_dtype = "auto"``) and held-out answers
in float32 (``[eval] sampling_dtype``, float32 on a CPU unless asked). Three studies:

- ``step``: one real step of the embedded default job (2 tasks x 4 rollouts on
  ``python_functions``, the composer recipe: rl, SDPO jsd, replay DPO), its samples
  collected once, then the learner's ``train_step`` timed on them in float32 and under
  bfloat16 autocast, alternating, median of ``--repeats``; both losses printed;
- ``decode``: the held-out evaluation's sampling (the first ``--tasks`` held-out prompts x 4
  samples at T=1, then greedy, 80 tokens, 64 rows at once) with the packed float32 kernels
  and with ``sampling_dtype = "bfloat16"``; tokens/s of each, and how many greedy answers
  are the same;
- ``job`` (``--job``): the whole ``composer-replication train`` (the embedded default) with
  ``model.dtype = "float32"`` and with ``"auto"`` (both measuring their start evaluation:
  ``eval.reuse_start = false``), and as a user runs it twice (``default`` then
  ``default_again``: no setting changed; the first measures its start evaluation unless an
  earlier run kept it, the second reads it back), for each ``--seeds``
  (about 9 minutes a run): wall time, median step, held-out greedy / sampled pass@1 before
  and after, and the sampler/trainer mismatch the bfloat16 learner adds (``kl/inference``,
  the share of rl tokens the trust region masks).

- ``agent`` (``--agent``; ``--agent-only``: it alone): ``train configs/runs/agent.toml``
  in float32 with reuse off, then the default command twice: wall time, the training
  process's peak RSS, median step, held-out resolved rate before and after.

``--variants`` chooses the job's and agent.toml's variants, the first being the one the
others are compared with; ``before`` is the code this work started from
(:data:`BEFORE_COMMIT`, run from a git worktree on the same interpreter): ``--job-only
--agent --variants before default default_again`` measures the goals' ratios in one run.

Run: ``python benchmarks/cpu_precision.py`` (step and decode, a few minutes);
``--job --seeds 0 1 2 --out DIR`` adds the whole job (``--bf16-evaluation``: the default
command with its held-out answers sampled in bfloat16 too; ``--job-only``: the job alone; finished runs are read back).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, checked_output, machine_line, refuse, write_json


def _bf16_cpu_or_exit() -> str:
    from composer_replication.model.devices import cpu_bfloat16_kernels

    kernels = cpu_bfloat16_kernels()
    if kernels is None:
        refuse(
            "the CPU",
            "no AMX or AVX512-BF16",
            "run it on a CPU with bfloat16 instructions (here auto stays float32)",
        )
    return kernels


def step_study(repeats: int) -> dict[str, Any]:
    import contextlib

    import torch

    from composer_replication.config import RunConfig
    from composer_replication.samples.wire import pack_samples
    from composer_replication.training.loop import Trainer
    from composer_replication.training.step import train_step

    with tempfile.TemporaryDirectory() as tmp:
        config = RunConfig.default([f"output_dir={tmp}/run", "model.dtype=float32"])
        trainer = Trainer(config)
        samples, _ = trainer.collect()
    policy, cfg = trainer.policy, trainer.learner.losses.current()
    pad_id = trainer.tokenizer.pad_token_id or 0
    batches = pack_samples(samples, max_tokens=config.micro_batch_tokens, pad_id=pad_id, split=None)
    teacher = trainer.learner.teachers.teacher(policy)
    ways = {
        "float32": contextlib.nullcontext,
        "bfloat16 autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    losses: dict[str, float] = {}
    for _ in range(repeats):
        for way, context in ways.items():
            policy.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with context():
                metrics = train_step(
                    policy,
                    batches,
                    cfg,
                    teacher=teacher,
                    reference=trainer.learner.teachers.reference,
                )
            times[way].append(time.perf_counter() - start)
            losses[way] = float(metrics["loss"])
    policy.zero_grad(set_to_none=True)
    tokens = sum(len(s.input_ids) for s in samples)
    out = {way: statistics.median(t) for way, t in times.items()}
    print(f"learner step of the default job ({len(samples)} samples, {tokens} tokens):")
    for way, seconds in out.items():
        print(f"  {way:18s}: {seconds:6.2f} s/step  (loss {losses[way]:.6f})")
    print(f"  bfloat16 / float32 speed: {out['float32'] / out['bfloat16 autocast']:.2f}x")
    return {"seconds": out, "loss": losses, "tokens": tokens}


def decode_study(n_tasks: int) -> dict[str, Any]:
    import torch

    from composer_replication.envs.python_functions import PythonFunctionsEnv
    from composer_replication.inference.decoding.generate import DecodeOptions, generate
    from composer_replication.model.loading import load_policy
    from composer_replication.safety import HeldoutSplit
    from composer_replication.samples.generation import SamplingSettings

    model, tokenizer = load_policy("embedded", device="cpu", dtype="float32")
    env = PythonFunctionsEnv()
    heldout = [t for t in env.task_ids() if HeldoutSplit().is_heldout(t)][:n_tasks]
    prompts = [env.prompt_ids(tokenizer, env.tasks[t]) for t in heldout]
    settings = {
        "sampled": (SamplingSettings(max_new_tokens=80, temperature=1.0), 4),
        "greedy": (SamplingSettings(max_new_tokens=80, temperature=0.0), 1),
    }
    result: dict[str, Any] = {}
    answers: dict[str, list[list[int]]] = {}
    for dtype in ("float32", "bfloat16"):
        options = DecodeOptions(loop="general", dtype=dtype)
        tokens, seconds = 0, 0.0
        for name, (sampling, copies) in settings.items():
            rows = [p for p in prompts for _ in range(copies)]
            torch.manual_seed(0)
            start = time.perf_counter()
            out = generate(model, tokenizer, rows, sampling, decode=options, max_rows=64)
            seconds += time.perf_counter() - start
            tokens += sum(len(g.completion_ids) for g in out)
            if name == "greedy":
                answers[dtype] = [g.completion_ids for g in out]
        result[dtype] = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}
    same = sum(a == b for a, b in zip(answers["float32"], answers["bfloat16"]))
    print(f"held-out sampling ({len(prompts)} prompts x 4 at T=1, then greedy; 80 tokens):")
    for dtype, r in result.items():
        print(
            f"  {dtype:9s}: {r['tokens']} tokens in {r['seconds']:.1f} s ({r['tok_s']:.1f} tok/s)"
        )
    print(
        f"  bfloat16 / float32 tokens/s: {result['bfloat16']['tok_s'] / result['float32']['tok_s']:.2f}x;"
        f" greedy answers identical: {same}/{len(prompts)}"
    )
    result["greedy_identical"] = same
    return result


#: The commit this work started from: the CPU path in float32, sandboxed children started
#: by fork, every start evaluation measured. The ``before`` variant runs its code (a git
#: worktree beside the runs, on the same interpreter and packages): the wall time the
#: goals were set against, measured in the same run as the others.
BEFORE_COMMIT = "f92fff97a0d5711ddfac1f7cb85c0c414b2dd28a"

#: the job's variants: their run-directory name -> the ``--set`` overrides
VARIANTS = {
    # the code before this work, as a user ran it (no setting changed)
    "before": [],
    "float32": ["model.dtype=float32", "eval.reuse_start=false"],
    "auto": ["model.dtype=auto", "eval.reuse_start=false"],
    # the command as a user runs it (a start evaluation kept by an earlier run is reused),
    # then again: the second run reads back the start evaluation the first one kept
    "default": [],
    "default_again": [],
    # the default command with held-out answers sampled in bfloat16 too
    "bf16_evaluation": ["eval.sampling_dtype=bfloat16"],
}


def _job(out: Path, variant: str, seed: int, config: Path | None = None) -> dict[str, Any]:
    """One ``train`` command (the default job, or ``config``) as ``variant`` sets it: its
    wall time, peak RSS (the training process's own, as ``/usr/bin/time`` reports it),
    steps and held-out scores."""
    name = f"{'' if config is None else config.stem + '_'}{variant}_seed{seed}"
    run_dir = out / name
    sets = [f"output_dir={run_dir}", *VARIANTS[variant], f"seed={seed}"]
    timing = out / f"{name}.timing.json"
    if not (run_dir / "summary.json").exists() or not timing.exists():
        env = dict(os.environ)
        if variant == "before":  # its own code first on the path
            env["PYTHONPATH"] = str(_code_before(out) / "src")
        start = time.perf_counter()
        command = [sys.executable, "-m", "composer_replication", "train"]
        command += [] if config is None else [str(config)]
        proc = subprocess.Popen(
            [*command, *(arg for value in sets for arg in ("--set", value))], env=env
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, command)
        # beside the run, not in its record; atomically
        write_json(
            timing,
            {
                "command_seconds": round(time.perf_counter() - start, 1),
                "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2),  # ru_maxrss is KiB
            },
        )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["time/step_s"] for r in rows if "time/step_s" in r]
    scores = {
        key: [r[key] for r in rows if key in r]
        for key in ("heldout/greedy_pass@1", "heldout/pass@1")
    }
    if not scores["heldout/greedy_pass@1"]:  # greedy-only evaluations (temperature 0)
        scores["heldout/greedy_pass@1"] = scores["heldout/pass@1"]
    summary = json.loads((run_dir / "summary.json").read_text())
    mismatch = [r["kl/inference"] for r in rows if "kl/inference" in r]
    masked = [r["rl/masked_fraction"] for r in rows if "rl/masked_fraction" in r]
    return {
        "greedy_solved": _greedy_solved(run_dir),
        "command_s": float(json.loads(timing.read_text())["command_seconds"]),
        "peak_rss_gb": json.loads(timing.read_text()).get("peak_rss_gb", float("nan")),
        "median_step_s": statistics.median(steps),
        "kl_inference": statistics.mean(mismatch) if mismatch else float("nan"),
        "rl_masked": statistics.mean(masked) if masked else float("nan"),
        "greedy": (scores["heldout/greedy_pass@1"][0], scores["heldout/greedy_pass@1"][-1]),
        "sampled": (scores["heldout/pass@1"][0], scores["heldout/pass@1"][-1]),
        "start_evaluation": summary.get("start_evaluation") or "measured",
    }


def _code_before(out: Path) -> Path:
    """A worktree of :data:`BEFORE_COMMIT` under ``out`` (made once)."""
    tree = out / f"code-{BEFORE_COMMIT[:12]}"
    if not (tree / "src" / "composer_replication").is_dir():
        repo = Path(__file__).resolve().parents[1]
        made = subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), BEFORE_COMMIT],
            capture_output=True,
            text=True,
        )
        if made.returncode:
            refuse(
                "the before variant",
                f"no worktree of {BEFORE_COMMIT[:12]} ({made.stderr.strip()[-200:]})",
                "run it from a git clone of the project with its history",
            )
    return tree


def _greedy_solved(run_dir: Path) -> tuple[int, int]:
    """(solved, tasks) of the last evaluation's greedy answers, from its saved rollouts."""
    last = sorted((run_dir / "rollouts").glob("eval_step_*.jsonl"))[-1]
    rows = [json.loads(line) for line in last.read_text().splitlines()]
    # greedy answers are marked, unless the evaluation sampled at temperature 0 only
    greedy = [r for r in rows if r["metadata"].get("greedy")] or rows
    return sum(r["reward"] == 1.0 for r in greedy), len(greedy)


def job_study(out: Path, seeds: list[int], variants: list[str]) -> dict[str, Any]:
    """The default job's ``variants`` per seed; the first is the one the others are
    compared with (wall time, greedy answers solved)."""
    results = {f"{v}/{s}": _job(out, v, s) for s in seeds for v in variants}
    base = variants[0]
    print("the whole default job (composer-replication train):")
    for s in seeds:
        reference = results[f"{base}/{s}"]
        for name in variants:
            r = results[f"{name}/{s}"]
            print(
                f"  seed {s} {name:18s}: {r['command_s']:6.1f} s (start evaluation "
                f"{r['start_evaluation']}), step {r['median_step_s']:5.1f} s, "
                f"greedy {r['greedy'][0]:.3f} -> {r['greedy'][1]:.3f}, "
                f"sampled {r['sampled'][0]:.3f} -> {r['sampled'][1]:.3f}, "
                f"KL sampler||trainer {r['kl_inference']:.2e}, rl masked {r['rl_masked']:.3f}"
            )
        for name in variants[1:]:
            r = results[f"{name}/{s}"]
            ratio = r["command_s"] / reference["command_s"]
            solved, tasks = r["greedy_solved"]
            print(
                f"  seed {s} {name} / {base} wall time: {ratio:.2f}x; greedy answers solved "
                f"after: {solved} of {tasks} ({base} {reference['greedy_solved'][0]}, "
                f"difference {solved - reference['greedy_solved'][0]:+d})"
            )
        if {"default", "default_again"} <= set(variants):
            again = (
                results[f"default_again/{s}"]["command_s"] / results[f"default/{s}"]["command_s"]
            )
            print(f"  seed {s} default_again / default wall time: {again:.2f}x")
    return results


AGENT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "runs" / "agent.toml"


def agent_study(out: Path, variants: list[str]) -> dict[str, Any]:
    """``train configs/runs/agent.toml`` (seed 0; its tasks made by an earlier run or the
    first one here) as each of ``variants`` runs it; the first is the one the others are
    compared with."""
    results = {v: _job(out, v, 0, AGENT_CONFIG) for v in variants}
    base = results[variants[0]]["command_s"]
    print("the agentic recipe (composer-replication train configs/runs/agent.toml):")
    for name in variants:
        r = results[name]
        print(
            f"  {name:14s}: {r['command_s']:6.1f} s ({r['command_s'] / base:.2f}x), "
            f"peak RSS {r['peak_rss_gb']:.2f} GB, start evaluation {r['start_evaluation']}, "
            f"median step {r['median_step_s']:5.1f} s, held-out resolved "
            f"{r['greedy'][0]:.3f} -> {r['greedy'][1]:.3f}"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=16, help="held-out prompts decoded")
    parser.add_argument("--job", action="store_true", help="also run the whole default job")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", default="runs/cpu_precision", help="where --job runs go")
    parser.add_argument(
        "--bf16-evaluation",
        action="store_true",
        help="--job also runs the default command with eval.sampling_dtype = bfloat16",
    )
    parser.add_argument("--job-only", action="store_true", help="skip the step and decode studies")
    parser.add_argument(
        "--agent",
        action="store_true",
        help="also run configs/runs/agent.toml: float32, then the default command twice "
        "(about 12 minutes a run)",
    )
    parser.add_argument("--agent-only", action="store_true", help="agent.toml's runs alone")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=sorted(VARIANTS),
        help="the variants to run, in order, the first being the one the others are compared "
        "with (the job's default: float32 auto default default_again, and bf16_evaluation with "
        "--bf16-evaluation; agent.toml's: float32 default default_again); before: the code "
        f"this work started from ({BEFORE_COMMIT[:12]})",
    )
    args = parser.parse_args()
    check_count(args.repeats, "--repeats")
    check_count(args.tasks, "--tasks")
    for seed in args.seeds:
        if seed < 0:
            refuse("--seeds", seed, "give seeds >= 0")
    args.job = (args.job or args.job_only) and not args.agent_only
    args.agent = args.agent or args.agent_only
    out = checked_output(args.out, "--out", directory=True) if args.job else None
    from composer_replication.model.cpu_threads import limit_thread_spinning

    limit_thread_spinning()
    kernels = _bf16_cpu_or_exit()
    print(f"machine: {machine_line()} (bfloat16: {kernels})")
    if not (args.job_only or args.agent_only):
        step_study(args.repeats)
        decode_study(args.tasks)
    if out is not None:
        variants = args.variants or [
            "float32",
            "auto",
            "default",
            "default_again",
            *(["bf16_evaluation"] if args.bf16_evaluation else []),
        ]
        job_study(Path(out), args.seeds, variants)
    if args.agent:
        variants = args.variants or ["float32", "default", "default_again"]
        agent_study(Path(checked_output(args.out, "--out", directory=True)), variants)


if __name__ == "__main__":
    main()
