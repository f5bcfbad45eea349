"""One GPU, one table: how much of the card sampling, training and a whole step use.

Run: ``python benchmarks/gpu.py`` on a machine with one GPU (under 8 minutes), or
``python benchmarks/gpu.py --device cpu --quick`` anywhere (a dry run of every section on a
small model, about a minute on 2 CPU cores).

Sections (``--sections``, all by default), each on SmolLM2-135M-Instruct (``--random-weights``:
its exact shape with random weights, nothing loaded, the same cost per token):

- ``sampling`` (and ``compiled``, its compiled side, last because it compiles): kept
  tokens per second at batch 8, 64 and 256 (python_functions prompts,
  128 new tokens, temperature 1, bfloat16 autocast as in training) for transformers'
  ``generate`` (the peer), our general loop (the host-driven one), our static loop eager
  (no graphs), with CUDA graphs (the default on a GPU) and compiled + graphs; and the
  bound a decode step cannot beat: the bytes it must read (the weights it multiplies by and
  the keys/values it attends to) over the card's measured copy bandwidth;
- ``train``: tokens per second of the learner's step (``Learner.update``: micro-batches
  packed to gpu.toml's token budget, the rl loss, AdamW) against a plain forward + backward
  + AdamW over the same micro-batches;
- ``steps``: seconds per step of the default recipe and of ``configs/runs/gpu.toml``, split
  into sampling, grading (+ scoring) and training, and the share of a step's wall time the
  GPU was busy (the union of the kernels' intervals in a profiler trace of one step).

With the real weights (no ``--random-weights``) ``--heldout MINUTES`` trains gpu.toml for that
long and prints greedy and sampled held-out pass@1 before and after, and ``--ablation
MINUTES`` does the same for composer, grpo and sdpo, one after the other.

Every section is timed after a warm-up call (graph capture and compilation are reported
apart). Results also go to ``--json PATH``. A section that fails prints its error and the
others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import (
    check_choices,
    check_count,
    check_number,
    checked_output,
    machine_line,
    refuse,
    write_json,
)

ROOT = Path(__file__).resolve().parents[1]

#: SmolLM2-135M's shape (30 layers, hidden 576, 9 heads over 3 key/value heads).
SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}
#: The --quick shape (and batch sizes, tokens) for a dry run on a CPU.
QUICK_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128}


def log(*parts: Any) -> None:
    print(*parts, flush=True)


# --------------------------------------------------------------------------- set-up


def make_model_dir(args: argparse.Namespace, where: Path) -> str:
    """The model source the runs load: a directory with random weights in SmolLM2-135M's
    shape (or the quick shape), or 'embedded'."""
    if not args.random_weights:
        return "embedded"
    from composer_replication.models import load_tokenizer, save_checkpoint, tiny_model

    shape = QUICK_SHAPE if args.quick else SMOLLM2_135M
    model = tiny_model(seed=0, **shape)
    tokenizer = load_tokenizer(args.tokenizer)
    return str(save_checkpoint(model, where / "model", tokenizer=tokenizer))


def load_model(source: str, device: Any) -> tuple[Any, Any]:
    """The policy as training holds it: float32 master weights on ``device``."""
    import torch

    from composer_replication.models import load_policy

    model, tokenizer = load_policy(source, dtype=torch.float32, device=device)
    return model.eval(), tokenizer


def autocast_context(device: Any) -> Any:
    import torch

    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def task_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` python_functions prompts as the environment renders them (tasks repeat when
    ``n`` exceeds the bank)."""
    from composer_replication.envs.python_functions import PythonFunctionsEnv

    env = PythonFunctionsEnv()
    ids = env.task_ids()
    return [env.prompt_ids(tokenizer, env.tasks[ids[i % len(ids)]]) for i in range(n)]


# --------------------------------------------------------------------------- sampling


def hf_sample(model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int) -> int:
    """transformers' ``generate`` at temperature 1 (no top-k / top-p); kept tokens."""
    import torch

    from composer_replication.rollout.generate import left_pad

    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, tokenizer.pad_token_id, device=device)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[:, ids.shape[1] :]
    eos = tokenizer.eos_token_id
    kept = 0
    for row in new.tolist():
        kept += row.index(eos) + 1 if eos in row else len(row)
    return kept


def ours_sample(
    model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int, options: Any
) -> int:
    from composer_replication.rollout.generate import SamplingSettings, decode_options, generate

    settings = SamplingSettings(max_new_tokens=new_tokens, temperature=1.0)
    with decode_options(options):
        rows = generate(model, tokenizer, prompts, settings, max_rows=len(prompts))
    return sum(len(r.completion_ids) for r in rows)


def copy_bandwidth(device: Any) -> float:
    """Bytes per second a device-to-device copy moves (read + write), measured."""
    import torch

    if device.type != "cuda":
        return float("nan")
    n = 1 << 28  # 1 GiB of float32
    a = torch.empty(n, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * 4 * n * 10 / (time.perf_counter() - start)


def decode_bytes(model: Any, rows: int, prompt_len: float, new_tokens: int) -> float:
    """Bytes one average decode step must read in bfloat16: every matrix it multiplies by
    (the embedding only by the rows it looks up) and the keys and values it attends to."""
    config = model.config
    layers, hidden = config.num_hidden_layers, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * config.intermediate_size
    weights = 2 * (layers * per_layer + config.vocab_size * hidden)
    context = prompt_len + new_tokens / 2
    cache = rows * context * layers * 2 * kv * 2
    return weights + cache


def section_sampling(
    args: argparse.Namespace, source: str, device: Any, only: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Sampling throughput of every side (``only``: just these sides)."""
    from composer_replication.rollout.generate import DecodeOptions

    model, tokenizer = load_model(source, device)
    batches = (2, 4) if args.quick else (8, 64, 256)
    new_tokens = 16 if args.quick else 128
    bandwidth = copy_bandwidth(device)
    sides = {
        "general": DecodeOptions(loop="general"),
        "static_eager": DecodeOptions(loop="static", cuda_graphs=False),
        "static_graphs": DecodeOptions(loop="static"),
        "static_compiled": DecodeOptions(loop="static", compile=True),
    }
    out: dict[str, Any] = {"new_tokens": new_tokens, "bandwidth_bytes_s": bandwidth}
    for rows in batches:
        prompts = task_prompts(tokenizer, rows)
        mean_prompt = statistics.mean(len(p) for p in prompts)
        entry: dict[str, Any] = {"prompt_tokens": mean_prompt}
        bound = rows / (decode_bytes(model, rows, mean_prompt, new_tokens) / bandwidth)
        entry["bound_tokens_s"] = bound
        runs = {"hf": lambda p=prompts: hf_sample(model, tokenizer, p, new_tokens)}
        for name, options in sides.items():
            runs[name] = lambda p=prompts, o=options: ours_sample(
                model, tokenizer, p, new_tokens, o
            )
        for name, run in runs.items():
            if only and name not in only:
                continue
            if name == "general" and rows > 64 and not args.quick:
                continue  # minutes at batch 256; batch 64 shows its slope
            try:
                with autocast_context(device):
                    start = time.perf_counter()
                    run()  # warm-up: graphs captured, steps compiled
                    synchronize(device)
                    first = time.perf_counter() - start
                    start = time.perf_counter()
                    kept = run()
                    synchronize(device)
                    seconds = time.perf_counter() - start
                entry[name] = {"tokens_s": kept / seconds, "seconds": seconds, "warmup_s": first}
                log(f"  sampling batch {rows:>3} {name:<16} {kept / seconds:>10,.0f} tokens/s")
            except Exception as err:  # a side that fails is reported, the others still run
                entry[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
                log(f"  sampling batch {rows:>3} {name:<16} failed: {entry[name]['error']}")
        out[f"batch_{rows}"] = entry
    return out


# --------------------------------------------------------------------------- train


def synthetic_samples(tokenizer: Any, n: int, prompt_len: int, completion_len: int) -> list:
    """``n`` rl training samples shaped like gpu.toml's rollouts (random completions)."""
    import random

    from composer_replication.wire import TrainingSample

    rng = random.Random(0)
    samples = []
    for i in range(n):
        p = prompt_len + rng.randint(-prompt_len // 4, prompt_len // 4)
        c = max(8, completion_len + rng.randint(-completion_len // 2, completion_len // 2))
        ids = [rng.randrange(3, 40000) for _ in range(p + c)]
        mask = [0] * p + [1] * c
        samples.append(
            TrainingSample(
                input_ids=ids,
                loss_mask=mask,
                inference_logprobs=[0.0] * p + [-rng.uniform(0.5, 3.0) for _ in range(c)],
                advantages=[0.0] * p + [(-1.0) ** i * 0.5] * c,
            )
        )
    return samples


def plain_step(model: Any, optimizer: Any, batches: list) -> None:
    """A plain fine-tune step over the same micro-batches: forward, token log-probs of the
    targets, their masked mean, backward; AdamW."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    for mb in batches:
        mb = mb.to(next(model.parameters()).device)
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), -1)
        picked = logprobs.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
        mask = mb.loss_mask[:, 1:].to(picked.dtype)
        (-(picked * mask).sum() / mask.sum().clamp_min(1)).backward()
    optimizer.step()


def section_train(args: argparse.Namespace, source: str, device: Any) -> dict[str, Any]:
    import torch

    from composer_replication.config.run import RunConfig
    from composer_replication.trainer.learner import Learner
    from composer_replication.wire import pack_samples

    config = RunConfig.from_toml(
        ROOT / "configs/runs/gpu.toml", [f"model.source={source}", f"model.device={device}"]
    )
    budget = 2048 if args.quick else config.micro_batch_tokens
    n, prompt_len, completion_len = (8, 40, 24) if args.quick else (256, 200, 160)
    model, tokenizer = load_model(source, device)
    model.train()
    samples = synthetic_samples(tokenizer, n, prompt_len, completion_len)
    batches = pack_samples(samples, max_tokens=budget, pad_id=tokenizer.pad_token_id, split=None)
    tokens = sum(int(mb.attention_mask.sum()) for mb in batches)
    out: dict[str, Any] = {
        "tokens": tokens,
        "micro_batches": len(batches),
        "token_budget": budget,
    }
    learner = Learner(config, model)
    plain_model, _ = load_model(source, device)
    plain_model.train()
    fused = {"fused": True} if device.type == "cuda" else {}
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-6, **fused)
    repeats = 1 if args.quick else 3
    for name, run in (
        ("ours", lambda: learner.update(batches, 1)),
        ("plain", lambda: plain_step(plain_model, plain_opt, batches)),
    ):
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            with autocast_context(device):
                run()  # warm-up
                synchronize(device)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    run()
                    synchronize(device)
                    times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            out[name] = {"tokens_s": tokens / seconds, "seconds": seconds, "peak_bytes": peak}
            log(f"  train {name:<6} {tokens / seconds:>10,.0f} tokens/s ({seconds:.2f} s)")
        except Exception as err:
            out[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            log(f"  train {name} failed: {out[name]['error']}")
    return out


# --------------------------------------------------------------------------- steps


def busy_fraction(run: Any, device: Any) -> float:
    """Share of ``run()``'s wall time during which a kernel ran on the GPU: NVML's
    utilisation (the share of each sample period with a kernel running) read every 20 ms,
    or without NVML the union of the kernel intervals of a profiler trace."""
    import threading

    import torch

    if device.type != "cuda":
        run()
        return float("nan")
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    except Exception:
        return _profiled_busy_fraction(run)
    readings: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            readings.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            stop.wait(0.02)

    torch.cuda.synchronize()
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        run()
        torch.cuda.synchronize()
    finally:
        stop.set()
        poller.join()
    return statistics.mean(readings) / 100 if readings else float("nan")


def _profiled_busy_fraction(run: Any) -> float:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy, end = 0.0, float("-inf")
    for lo, hi in intervals:
        if hi <= end:
            continue
        busy += hi - max(lo, end)
        end = hi
    return busy / wall_us if wall_us else float("nan")


def profiled_step(run: Any, trace: Path) -> None:
    """``run()`` under torch's profiler: ``trace`` gets the operators' table (by device time
    and by count, with call sites) as text, for finding where a step's time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, with_stack=False, record_shapes=False) as prof:
        run()
    averages = prof.key_averages()
    by_time = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    trace.write_text(
        averages.table(sort_by=by_time, row_limit=40)
        + "\n\n"
        + averages.table(sort_by="count", row_limit=40)
    )
    log(f"  profile of one step: {trace}")


def recipe_steps(
    config_path: Path,
    source: str,
    device: Any,
    steps: int,
    overrides: list[str],
    where: Path,
    trace: Path | None = None,
) -> dict[str, Any]:
    """``steps`` steps of a recipe through the trainer; median seconds of the steps after
    the first, split by phase; and the GPU's busy share over the last step. ``trace``: also
    profile one more step into that file."""
    from composer_replication.config.run import RunConfig
    from composer_replication.distributed.data_parallel import autocast_for
    from composer_replication.rollout.generate import DecodeOptions, decode_options
    from composer_replication.trainer.loop import Trainer

    config = RunConfig.from_toml(
        config_path,
        [
            f"model.source={source}",
            f"model.device={device}",
            f"output_dir={where}",
            f"steps={steps + 1}",
            *overrides,
        ],
    )
    trainer = Trainer(config, console=None, run_dir=where)
    rows = []
    with (
        decode_options(DecodeOptions.of(config.inference)),
        autocast_for(config, trainer.policy, trainer.ranks),
    ):
        for _ in range(steps - 1):
            rows.append(trainer.train_one_step())
        holder: dict[str, Any] = {}
        busy = busy_fraction(lambda: holder.update(trainer.train_one_step()), device)
        rows.append(holder)
        if trace is not None:  # one more step under the profiler, after the measured ones
            profiled_step(lambda: trainer.train_one_step(), trace)
    measured = rows[1:] if len(rows) > 1 else rows

    def median(key: str) -> float:
        return statistics.median(float(r.get(key, 0.0)) for r in measured)

    sample = median("time/generate_s")
    collect = median("time/generate_score_s")
    return {
        "step_s": median("time/step_s"),
        "sample_s": sample,
        "grade_score_s": max(0.0, collect - sample),
        "train_s": median("time/train_s"),
        "sampled_tokens": median("tokens/sampled"),
        "train_tokens": median("tokens/total"),
        "first_step_s": float(rows[0]["time/step_s"]),
        "gpu_busy": busy,
    }


def section_steps(args: argparse.Namespace, source: str, device: Any, where: Path) -> dict:
    steps = 2 if args.quick else args.steps
    recipes = {
        "default": (ROOT / "configs/runs/default.toml", []),
        "gpu": (ROOT / "configs/runs/gpu.toml", []),
    }
    quick = ["envs.0.tasks_per_step=2", "envs.0.algorithm.sampling.max_new_tokens=16"]
    out = {}
    for name, (path, overrides) in recipes.items():
        try:
            result = recipe_steps(
                path,
                source,
                device,
                steps,
                overrides + (quick if args.quick else []),
                where / name,
                trace=None if args.profile is None else args.profile / f"step_{name}.txt",
            )
            out[name] = result
            log(
                f"  step {name:<8} {result['step_s']:.2f} s = sample {result['sample_s']:.2f}"
                f" + grade {result['grade_score_s']:.2f} + train {result['train_s']:.2f}"
                f"; GPU busy {result['gpu_busy']:.0%}"
            )
        except Exception as err:
            out[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            log(f"  step {name} failed: {out[name]['error']}")
            if args.debug:
                traceback.print_exc()
    return out


# --------------------------------------------------------------------------- held-out


def heldout_runs(
    args: argparse.Namespace, source: str, minutes: float, algorithms: list[str], where: Path
) -> dict:
    """gpu.toml with each algorithm for ``minutes`` (the run's clock, its first evaluation
    included): greedy and sampled held-out pass@1 before and after."""
    from composer_replication.config.run import RunConfig
    from composer_replication.trainer.loop import Trainer

    quick = [
        "envs.0.tasks_per_step=2",
        "envs.0.algorithm.sampling.max_new_tokens=16",
        "eval.max_tasks=4",
        "eval.samples_per_task=2",
    ]
    out = {}
    for algorithm in algorithms:
        run_dir = where / algorithm
        overrides = [
            f"model.source={source}",
            f"model.device={args.device}",
            f"output_dir={run_dir}",
            # the run's clock includes its first evaluation (seconds on a GPU)
            f"max_wall_seconds={minutes * 60}",
            *(quick if args.quick else []),
        ]
        if algorithm != "composer":  # the algorithm's own defaults, nothing of composer's
            overrides.append(f'envs.0.algorithm.advantage={{"type": "{algorithm}"}}')
        try:
            config = RunConfig.from_toml(ROOT / "configs/runs/gpu.toml", overrides)
            start = time.perf_counter()
            result = Trainer(config, console=None, run_dir=run_dir).run()
            rows = [r for r in result.metrics if "heldout/greedy_pass@1" in r]
            entry = {
                "steps": result.steps,
                "seconds": time.perf_counter() - start,
                "greedy_before": rows[0]["heldout/greedy_pass@1"] if rows else None,
                "greedy_after": rows[-1]["heldout/greedy_pass@1"] if rows else None,
                "sampled_before": result.heldout_before,
                "sampled_after": result.heldout_after,
            }
            out[algorithm] = entry
            log(f"  held-out {algorithm}: {entry}")
        except Exception as err:
            out[algorithm] = {"error": f"{type(err).__name__}: {err}"[:300]}
            log(f"  held-out {algorithm} failed: {out[algorithm]['error']}")
            if args.debug:
                traceback.print_exc()
    return out


# --------------------------------------------------------------------------- table


def _cell(entry: dict | None, key: str = "tokens_s") -> str:
    if not entry:
        return "-"
    if "error" in entry:
        return "failed"
    return f"{entry[key]:,.0f}"


def table(results: dict[str, Any]) -> str:
    lines = [f"# {results['machine']}", ""]
    sampling = results.get("sampling", {})
    if "error" not in sampling and sampling:
        lines += [
            f"Sampling, kept tokens/s ({sampling['new_tokens']} new tokens, T=1):",
            "| batch | transformers | general | static eager | static graphs | "
            "static compiled | bound | graphs / transformers | graphs / bound |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key, entry in sampling.items():
            if not key.startswith("batch_"):
                continue
            hf, best = entry.get("hf", {}), entry.get("static_graphs", {})
            ratio = bound_ratio = "-"
            if "tokens_s" in hf and "tokens_s" in best:
                ratio = f"{best['tokens_s'] / hf['tokens_s']:.1f}x"
            if "tokens_s" in best and entry["bound_tokens_s"] == entry["bound_tokens_s"]:
                bound_ratio = f"{best['tokens_s'] / entry['bound_tokens_s']:.0%}"
            lines.append(
                f"| {key[6:]} | {_cell(hf)} | {_cell(entry.get('general'))} | "
                f"{_cell(entry.get('static_eager'))} | {_cell(best)} | "
                f"{_cell(entry.get('static_compiled'))} | {entry['bound_tokens_s']:,.0f} | "
                f"{ratio} | {bound_ratio} |"
            )
        lines.append("")
    train = results.get("train", {})
    if train and "error" not in train:
        ours, plain = train.get("ours", {}), train.get("plain", {})
        ratio = "-"
        if "tokens_s" in ours and "tokens_s" in plain:
            ratio = f"{ours['tokens_s'] / plain['tokens_s']:.2f}x"
        lines += [
            f"Training, tokens/s ({train['tokens']:,} tokens in {train['micro_batches']} "
            f"micro-batches of <= {train['token_budget']:,}):",
            "| learner step | plain forward+backward+AdamW | ratio |",
            "|---|---|---|",
            f"| {_cell(ours)} | {_cell(plain)} | {ratio} |",
            "",
        ]
    steps = results.get("steps", {})
    if steps and "error" not in steps:
        lines += [
            "Seconds per step (median after the first):",
            "| recipe | step | sample | grade+score | train | sampled tokens | train tokens "
            "| GPU busy |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in steps.items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error'][:80]} |||||||")
                continue
            lines.append(
                f"| {name} | {r['step_s']:.2f} | {r['sample_s']:.2f} | {r['grade_score_s']:.2f}"
                f" | {r['train_s']:.2f} | {r['sampled_tokens']:,.0f} | {r['train_tokens']:,.0f}"
                f" | {r['gpu_busy']:.0%} |"
            )
    for key in ("heldout", "ablation"):
        runs = results.get(key)
        if not runs:
            continue
        lines += [
            "",
            f"Held-out pass@1 ({key}; gpu.toml, greedy and sampled, before -> after):",
            "| algorithm | steps | greedy | sampled |",
            "|---|---|---|---|",
        ]
        for name, r in runs.items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error'][:80]} | | |")
                continue
            lines.append(
                f"| {name} | {r['steps']} | {_pair(r['greedy_before'], r['greedy_after'])} | "
                f"{_pair(r['sampled_before'], r['sampled_after'])} |"
            )
    return "\n".join(lines)


def _pair(before: float | None, after: float | None) -> str:
    if before is None or after is None:
        return "-"
    return f"{before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points)"


def merge(results: dict[str, Any], key: str, found: dict[str, Any]) -> None:
    """``found`` into ``results[key]``, one level down (batch entries keep their sides)."""
    into = results.setdefault(key, {})
    for name, value in found.items():
        if isinstance(value, dict) and isinstance(into.get(name), dict):
            into[name].update(value)
        else:
            into[name] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="with --random-weights: a directory holding SmolLM2's tokenizer files "
        "(default: the embedded model's)",
    )
    parser.add_argument("--quick", action="store_true", help="a small model: a dry run")
    parser.add_argument("--sections", default="sampling,train,steps,compiled")
    parser.add_argument("--steps", type=int, default=3, help="steps per recipe (>= 2)")
    parser.add_argument("--heldout", type=float, default=0.0, metavar="MINUTES")
    parser.add_argument("--ablation", type=float, default=0.0, metavar="MINUTES")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="steps: profile one more step of each recipe, its operator tables to DIR",
    )
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.random_weights = True
    sections = check_choices(
        args.sections, "--sections", ("sampling", "train", "steps", "compiled")
    )
    check_count(args.steps, "--steps", minimum=2, what="steps", why="the first compiles")
    check_number(args.heldout, "--heldout", what="minutes", why="0: none")
    check_number(args.ablation, "--ablation", what="minutes", why="0: none")
    if args.random_weights and args.tokenizer is not None:
        tokenizer = Path(args.tokenizer).expanduser()
        # a directory, or a model id of the local Hugging Face cache ("org/name")
        looks_like_path = args.tokenizer.startswith(("/", ".", "~")) or tokenizer.exists()
        if looks_like_path and not tokenizer.is_dir():
            what = "is not a folder" if tokenizer.exists() else "does not exist"
            fix = "pass the folder holding SmolLM2's tokenizer files, or leave it out"
            refuse("--tokenizer", repr(args.tokenizer), f"{what}; {fix}")
    args.json = checked_output(args.json, "--json")
    args.profile = checked_output(args.profile, "--profile", directory=True)
    import torch

    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        refuse("--device", repr(args.device), "use cuda, cuda:N or cpu")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py: no CUDA device here; use --device cpu --quick for a dry run")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    results: dict[str, Any] = {"machine": f"{name}; {machine_line()}"}
    log(results["machine"])
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        source = make_model_dir(args, where)
        for section in sections:
            log(f"[{section}]")
            start = time.perf_counter()
            try:
                if section == "sampling":  # compiled: its own section (compilation time)
                    sides = ("hf", "general", "static_eager", "static_graphs")
                    merge(results, "sampling", section_sampling(args, source, device, sides))
                elif section == "compiled":
                    only = ("static_compiled",)
                    merge(results, "sampling", section_sampling(args, source, device, only))
                elif section == "train":
                    results[section] = section_train(args, source, device)
                elif section == "steps":
                    results[section] = section_steps(args, source, device, where / "runs")
                else:
                    raise ValueError(f"unknown section {section!r}")
            except Exception as err:
                results[section] = {"error": f"{type(err).__name__}: {err}"[:300]}
                log(f"  {section} failed: {results[section]['error']}")
                if args.debug:
                    traceback.print_exc()
            log(f"  ({time.perf_counter() - start:.0f} s)")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.json:
                write_json(args.json, results)
        if args.random_weights and (args.heldout or args.ablation):
            log("held-out pass@1 of random weights says nothing: a dry run of the code path")
        if args.heldout:
            results["heldout"] = heldout_runs(
                args, source, args.heldout, ["composer"], where / "heldout"
            )
        if args.ablation:
            results["ablation"] = heldout_runs(
                args, source, args.ablation, ["composer", "grpo", "sdpo"], where / "ablation"
            )
    if args.json:
        write_json(args.json, results)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
