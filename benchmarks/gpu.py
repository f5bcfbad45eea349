"""One GPU, one table: how much of the card sampling, training and a whole step use, and
whether the project's GPU goals are met.

Run ``python benchmarks/gpu.py --all --random-weights --tokenizer DIR --out DIR`` on a
machine with one GPU: every goal below measured within ``--budget`` seconds (480 by
default; each part has its share and prints progress lines), then ``DIR/gpu.json`` (every
number, and one row per goal) and ``DIR/gpu.md`` (the tables and the goals table).
``python benchmarks/gpu.py --all --device cpu --quick --out DIR`` is the CI dry run: the
same code paths on a tiny model, about a minute on 2 CPU cores, the same files, every goal
row marked "not measured on CPU".

The goals (``_gpu_goals.GOALS``), each from one part:

- ``steps``: the composer step (``configs/runs/gpu.toml`` through ``Trainer.run``) keeps the
  GPU busy >= 60% of its wall time, busy being the union of the kernels' intervals in a
  profiler trace of one step (NVML's utilisation is printed beside it: it counts a
  launch-bound decode, one tiny kernel at a time, as fully busy); with
  ``[inference] async_level = 1`` a step takes <= 1.15x max(sample + grade, train) of the
  ``async_level = 0`` run (a build whose config refuses it is marked "not available in
  this build"); the peak memory of each phase (sample, grade, train:
  ``torch.cuda.max_memory_allocated`` reset when the phase begins) leaves >= 10% of 80 GB
  spare;
- ``train``: the learner's step (``Learner.update``) with the rl loss alone is >= 1.05x a
  plain forward + backward + fused AdamW of the same tokens, and with every composer
  component (rl, jsd, dpo) >= 50% of the rl-only step's tokens/s (tokens of the same
  rollouts in all three);
- ``sampling``: our static decode loop with CUDA graphs at batch 64 samples >= 10x the
  kept tokens/s of transformers' ``generate`` on the same card.

Without ``--all`` the sections (``--sections``) are the detailed ones: ``sampling`` at batch
8, 64 and 256 for every side (transformers, our general loop, the static loop eager and
with CUDA graphs) beside the bound a decode step cannot beat (the bytes it must read over
the card's copy bandwidth), ``compiled`` (the static loop compiled, last because it
compiles), ``train`` and ``steps`` (the default recipe too).

``--random-weights``: SmolLM2-135M-Instruct's exact shape with random weights (nothing
loaded, the same cost per token). Random weights solve no task, so every group would score
0 and no advantage would be non-zero: their rollouts get seeded synthetic rewards instead
(``_gpu_goals.synthetic_group_rewards``: a hash of the seed, the task, the row and its
completion tokens), graded for real first so grading costs what it costs; the step table
shows the tokens each loss component trained on (rl > 0).

With the real weights ``--heldout MINUTES`` trains gpu.toml for that long and prints greedy
and sampled held-out pass@1 before and after, and ``--ablation MINUTES`` does the same for
composer, grpo and sdpo, one after the other.

On a GPU machine without network: the package needs pydantic (its configs), carried as
wheels, and ``--random-weights`` needs SmolLM2's tokenizer files in a folder
(``--tokenizer``): ``tokenizer.json``, ``tokenizer_config.json`` and
``chat_template.jinja`` of the embedded model's directory
(``composer_replication.model.loading.embedded_model_dir()``). Run with ``PYTHONPATH=src``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _gpu_goals import (
    PartBudget,
    busy_share,
    evaluate_goals,
    goals_table,
    synthetic_group_rewards,
)
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
GPU_RECIPE = ROOT / "configs/runs/gpu.toml"

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
#: The seed of the synthetic rewards (and of the train part's synthetic rollouts).
REWARD_SEED = 0
#: --all: each part's share of --budget (the rest: making the model, writing the files).
SHARES = {"sampling": 0.12, "train": 0.22, "steps_async_0": 0.30, "steps_async_1": 0.26}
#: --steps run smaller under --quick (a CPU dry run)
QUICK_STEP_OVERRIDES = [
    "envs.0.tasks_per_step=2",
    "envs.0.algorithm.sampling.group_size=4",
    "envs.0.algorithm.sampling.max_new_tokens=16",
    "micro_batch_tokens=2048",
]


def log(*parts: Any) -> None:
    print(*parts, flush=True)


def failure(err: BaseException) -> dict[str, str]:
    return {"error": f"{type(err).__name__}: {err}"[:300]}


# --------------------------------------------------------------------------- set-up


def make_model_dir(args: argparse.Namespace, where: Path) -> str:
    """The model source the runs load: a directory with random weights in SmolLM2-135M's
    shape (or the quick shape), or 'embedded'."""
    if not args.random_weights:
        return "embedded"
    from composer_replication.model.loading import load_tokenizer, save_checkpoint, tiny_model

    shape = QUICK_SHAPE if args.quick else SMOLLM2_135M
    model = tiny_model(seed=0, **shape)
    tokenizer = load_tokenizer(args.tokenizer)
    return str(save_checkpoint(model, where / "model", tokenizer=tokenizer))


def load_model(source: str, device: Any) -> tuple[Any, Any]:
    """The policy as training holds it: float32 master weights on ``device``."""
    import torch

    from composer_replication.model.loading import load_policy

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


# --------------------------------------------------------------------------- observers


class PhasePeaks:
    """Peak GPU memory of each phase of a step: ``enter(phase)`` closes the phase before
    (its peak is ``torch.cuda.max_memory_allocated`` since it began, kept as the largest
    over steps) and resets the peak for the next. Phases must not overlap (sampling ahead
    runs them in two threads: only a run's whole peak means something there). On a CPU
    every peak is None."""

    PHASES = ("sample", "grade", "train")

    def __init__(self, device: Any) -> None:
        self.device = device
        self.current: str | None = None
        self.peaks: dict[str, int] = {}

    def enter(self, phase: str | None) -> None:
        if self.device.type == "cuda":
            import torch

            if self.current is not None:
                peak = torch.cuda.max_memory_allocated(self.device)
                self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.current = phase

    def wrap(self, fn: Any, phase: str) -> Any:
        """``fn`` observed as ``phase``."""

        def observed(*args: Any, **kwargs: Any) -> Any:
            self.enter(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.enter(None)

        return observed

    def result(self) -> dict[str, int | None]:
        return {p: self.peaks.get(p) if self.device.type == "cuda" else None for p in self.PHASES}


class NvmlPoller:
    """NVML's GPU utilisation (the share of each sample period in which a kernel ran),
    read every 20 ms while the ``with`` block runs; ``mean`` is None without NVML."""

    def __init__(self, device: Any) -> None:
        self.readings: list[int] = []
        self.stop = threading.Event()
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self.pynvml = pynvml
        except Exception:  # no NVML: the kernel union still says how busy the card was
            self.handle = None

    def _poll(self) -> None:
        while not self.stop.is_set():
            self.readings.append(self.pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            self.stop.wait(0.02)

    def __enter__(self) -> NvmlPoller:
        if self.handle is not None:
            self.thread = threading.Thread(target=self._poll, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.stop.set()
            self.thread.join()

    @property
    def mean(self) -> float | None:
        return statistics.mean(self.readings) / 100 if self.readings else None


def kernel_intervals(prof: Any) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every CUDA kernel in a finished profiler session
    (copies and memsets left out: they run on the copy engines, not the SMs)."""
    from torch.autograd import DeviceType

    return [
        (float(e.time_range.start), float(e.time_range.end))
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    ]


def measure_busy(run: Any, device: Any, table: Path | None = None) -> tuple[Any, dict]:
    """``run()`` under torch's profiler with NVML polled beside it; returns its result and
    ``gpu_busy_kernels`` (the union of the kernels' intervals over the region's wall time),
    ``gpu_busy_nvml`` and ``profiled_s``. ``table``: also the operators' table (by device
    time and by count) as text there. On a CPU, ``run()`` alone and None for both."""
    import torch

    if device.type != "cuda":
        return run(), {"gpu_busy_kernels": None, "gpu_busy_nvml": None}
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA]
    if table is not None:
        activities.append(ProfilerActivity.CPU)
    torch.cuda.synchronize(device)
    # NVML stops (exits first) before the profiler digests its trace
    with profile(activities=activities) as prof, NvmlPoller(device) as nvml:
        start = time.perf_counter()
        result = run()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    busy: dict[str, Any] = {"gpu_busy_nvml": nvml.mean, "profiled_s": wall}
    try:
        busy["gpu_busy_kernels"] = busy_share(kernel_intervals(prof), wall * 1e6)
    except Exception as err:  # the NVML reading still stands
        busy["gpu_busy_kernels"] = None
        busy["kernel_error"] = f"{type(err).__name__}: {err}"[:300]
    if table is not None:
        averages = prof.key_averages()
        table.write_text(
            averages.table(sort_by="self_cuda_time_total", row_limit=40)
            + "\n\n"
            + averages.table(sort_by="count", row_limit=40)
        )
        log(f"  profile of one step: {table}")
    return result, busy


# --------------------------------------------------------------------------- sampling


def hf_sample(model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int) -> int:
    """transformers' ``generate`` at temperature 1 (no top-k / top-p); kept tokens."""
    import torch

    from composer_replication.inference.decoding.padding import left_pad

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
    from composer_replication.inference.decoding.generate import SamplingSettings, generate

    settings = SamplingSettings(max_new_tokens=new_tokens, temperature=1.0)
    rows = generate(model, tokenizer, prompts, settings, decode=options, max_rows=len(prompts))
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
    args: argparse.Namespace,
    source: str,
    device: Any,
    batches: tuple[int, ...],
    only: tuple[str, ...] = (),
    budget: PartBudget | None = None,
) -> dict[str, Any]:
    """Sampling throughput of every side at each batch size (``only``: just these sides);
    ``budget``: sides past it are skipped (each side's first call is its warm-up)."""
    from composer_replication.inference.decoding.generate import DecodeOptions

    model, tokenizer = load_model(source, device)
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
            if budget is not None and budget.left() <= 0:
                entry[name] = {"error": f"skipped: the part's {budget.seconds:.0f} s were used"}
                log(f"  sampling batch {rows:>3} {name:<16} skipped (over budget)")
                continue
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
                entry[name] = failure(err)
                log(f"  sampling batch {rows:>3} {name:<16} failed: {entry[name]['error']}")
        out[f"batch_{rows}"] = entry
    return out


# --------------------------------------------------------------------------- train


def synthetic_groups(
    tokenizer: Any, vocab: int, n_tasks: int, group: int, completion: tuple[int, int]
) -> list[list[Any]]:
    """``n_tasks`` groups of ``group`` rollouts shaped like gpu.toml's: a python_functions
    prompt, random completions of ``completion`` (min, max) tokens with sampler log-probs,
    seeded synthetic rewards, the grader's feedback where a row is below its group's best
    (an SDPO error site) and the task's reference solution (seeded: the same groups in
    every run)."""
    from composer_replication.envs.python_functions import (
        PythonFunctionsEnv,
        reference_demonstration,
    )
    from composer_replication.samples.rollouts import REFERENCE_KEY, Rollout

    env = PythonFunctionsEnv()
    rng = random.Random(REWARD_SEED)
    groups = []
    for task_id in env.task_ids()[:n_tasks]:
        task = env.tasks[task_id]
        prompt = env.prompt_ids(tokenizer, task)
        completions = [
            [rng.randrange(3, vocab) for _ in range(rng.randint(*completion))] for _ in range(group)
        ]
        rewards = synthetic_group_rewards(REWARD_SEED, task_id, completions)
        best = max(rewards)
        groups.append(
            [
                Rollout(
                    task_id=task_id,
                    prompt_ids=list(prompt),
                    completion_ids=ids,
                    inference_logprobs=[-rng.uniform(0.5, 3.0) for _ in ids],
                    reward=reward,
                    prompt_messages=env.messages(task),
                    feedback=None if reward == best else "AssertionError: 2 of 5 tests failed",
                    metadata={REFERENCE_KEY: reference_demonstration(task)},
                )
                for ids, reward in zip(completions, rewards)
            ]
        )
    return groups


def algorithm_samples(config: Any, tokenizer: Any, policy: Any, groups: list) -> list:
    """Training samples of ``groups`` as the loop makes them: the config's algorithm
    processes each group, then scores the batch."""
    import asyncio

    from composer_replication.algo import build_algorithm

    algorithm = build_algorithm(
        config.envs[0].algorithm, tokenizer=tokenizer, policy=policy, rng=random.Random(0)
    )
    samples = []
    for group in groups:
        samples += algorithm.process_group(list(group))
    asyncio.run(algorithm.score(samples))
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


def timed_repeats(
    run: Any, device: Any, budget: PartBudget | None, most: int
) -> tuple[list[float], Any]:
    """``run()`` once to warm up, then timed up to ``most`` times (at least once; more only
    while ``budget`` has room for another); the times and the last result."""
    with autocast_context(device):
        run()
        synchronize(device)
        times: list[float] = []
        result = None
        while len(times) < most and (
            not times or budget is None or budget.allows(statistics.median(times))
        ):
            start = time.perf_counter()
            result = run()
            synchronize(device)
            times.append(time.perf_counter() - start)
    return times, result


def train_step(name: str, config: Any, model: Any, batches: list, device: Any) -> Any:
    """One step of ``name`` over ``batches`` as a call: "plain" (fused AdamW on a GPU) or
    a learner built from ``config``."""
    import functools

    import torch

    from composer_replication.training.learner import Learner

    if name == "plain":
        fused = {"fused": True} if device.type == "cuda" else {}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, **fused)
        return functools.partial(plain_step, model, optimizer, batches)
    return functools.partial(
        Learner(
            model,
            model=config.model,
            optim=config.optim,
            loss=config.loss,
            steps=config.steps,
        ).update,
        batches,
        1,
    )


def component_tokens(row: dict[str, Any]) -> dict[str, float]:
    """The tokens (pairs) each loss component trained on, from a learner's metrics (a
    component is what has a ``loss/<name>``)."""
    return {
        name: float(row[f"tokens/{name}"])
        for name in (key.removeprefix("loss/") for key in row if key.startswith("loss/"))
        if f"tokens/{name}" in row
    }


def said_tokens(parts: dict[str, float]) -> str:
    """``rl 1,234, jsd 567, ...``: the rl component always, the others where non-zero."""
    shown = {k: v for k, v in parts.items() if v or k == "rl"}
    return ", ".join(f"{k} {v:,.0f}" for k, v in sorted(shown.items())) or "-"


def section_train(
    args: argparse.Namespace, source: str, device: Any, budget: PartBudget | None = None
) -> dict[str, Any]:
    """Tokens/s of a plain step, the rl-only learner and the composer learner over the same
    rollouts (gpu.toml's shape: 64 tasks x 8 rollouts of up to 256 tokens)."""
    import torch

    from composer_replication.config.run import RunConfig
    from composer_replication.samples.wire import pack_samples

    base = [f"model.source={source}", f"model.device={device}"]
    configs = {
        "rl": RunConfig.from_toml(
            GPU_RECIPE, [*base, 'envs.0.algorithm.advantage={"type": "grpo"}']
        ),
        "composer": RunConfig.from_toml(GPU_RECIPE, base),
    }
    token_budget = 2048 if args.quick else configs["composer"].micro_batch_tokens
    n_tasks, group, completion = (2, 4, (8, 24)) if args.quick else (64, 8, (64, 256))
    _, tokenizer = load_model(source, device)
    groups = synthetic_groups(tokenizer, len(tokenizer), n_tasks, group, completion)
    rollout_tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for g in groups for r in g)
    pad = tokenizer.pad_token_id
    out: dict[str, Any] = {
        "rollouts": n_tasks * group,
        "tokens": rollout_tokens,
        "token_budget": token_budget,
    }
    most = 1 if args.quick else 3
    for name in ("plain", "rl", "composer"):
        if budget is not None and budget.left() <= 0:
            out[name] = {"error": f"skipped: the part's {budget.seconds:.0f} s were used"}
            log(f"  train {name} skipped (over budget)")
            continue
        try:
            model, _ = load_model(source, device)
            model.train()
            config = configs["rl" if name == "plain" else name]
            samples = algorithm_samples(config, tokenizer, model, groups)
            batches = pack_samples(samples, max_tokens=token_budget, pad_id=pad, split=None)
            run = train_step(name, config, model, batches, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times, row = timed_repeats(run, device, budget, most)
            seconds = statistics.median(times)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            out[name] = {
                "tokens_s": rollout_tokens / seconds,
                "seconds": seconds,
                "repeats": len(times),
                "micro_batches": len(batches),
                "peak_bytes": peak,
            }
            if row is not None:
                out[name]["component_tokens"] = component_tokens(row)
                out[name]["learner_tokens"] = float(row.get("tokens/total", 0.0))
            said = said_tokens(out[name].get("component_tokens", {}))
            log(
                f"  train {name:<8} {rollout_tokens / seconds:>10,.0f} tokens/s"
                f" ({seconds:.2f} s, {len(batches)} micro-batches; tokens per component: {said})"
            )
            del model, run
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as err:
            out[name] = failure(err)
            log(f"  train {name} failed: {out[name]['error']}")
            if args.debug:
                traceback.print_exc()
    return out


# --------------------------------------------------------------------------- steps


def benchmark_env(options: dict[str, Any], reward_seed: int | None, phases: PhasePeaks) -> Any:
    """python_functions as a benchmark step runs it (see :class:`BenchmarkEnv`)."""
    from composer_replication.envs.python_functions import PythonFunctionsEnv

    class BenchmarkEnv(PythonFunctionsEnv):
        """python_functions with each ``rollouts`` call's sampling and grading observed
        apart (``phases``; what follows ``sample`` inside ``rollouts`` is the grading) and,
        with ``reward_seed``, the graded rewards replaced by seeded synthetic ones (random
        weights solve nothing: every advantage would be zero)."""

        def sample(self, *args: Any, **kwargs: Any) -> Any:
            phases.enter("sample")
            groups = super().sample(*args, **kwargs)
            phases.enter("grade")
            return groups

        def rollouts(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return self.rewarded(super().rollouts(*args, **kwargs))
            finally:
                phases.enter(None)

        def grade_groups(self, groups: Any) -> Any:
            return self.rewarded(super().grade_groups(groups))

        def rewarded(self, groups: Any) -> list[list[Any]]:
            from dataclasses import replace

            if reward_seed is None:
                return [list(g) for g in groups]
            out = []
            for group in groups:
                if not group:
                    out.append([])
                    continue
                completions = [r.completion_ids for r in group]
                rewards = synthetic_group_rewards(reward_seed, group[0].task_id, completions)
                out.append([replace(r, reward=w) for r, w in zip(group, rewards)])
            return out

    return BenchmarkEnv(**options)


class StepObserver:
    """Stands in for a trainer's ``train_one_step`` (the loop calls it through the
    instance): keeps every step's row; step ``profile_step`` runs under the profiler
    (:func:`measure_busy`)."""

    def __init__(
        self, trainer: Any, device: Any, *, profile_step: int = 2, table: Path | None = None
    ) -> None:
        self.step = trainer.train_one_step
        trainer.train_one_step = self
        self.device = device
        self.profile_step = profile_step
        self.table = table
        self.rows: list[dict[str, Any]] = []
        self.busy: dict[str, Any] = {}

    def __call__(self) -> dict[str, Any]:
        if len(self.rows) + 1 == self.profile_step:
            row, self.busy = measure_busy(self.step, self.device, self.table)
        else:
            row = self.step()
        self.rows.append(row)
        n = len(self.rows)
        log(
            f"    step {n}: {row.get('time/step_s', 0.0):.2f} s"
            f"{' (profiled)' if n == self.profile_step and self.device.type == 'cuda' else ''}"
        )
        return row


def recipe_run(
    config_path: Path,
    source: str,
    device: Any,
    *,
    steps: int,
    overrides: list[str],
    where: Path,
    reward_seed: int | None,
    seconds: float | None = None,
    table: Path | None = None,
) -> dict[str, Any]:
    """``steps`` steps of a recipe through ``Trainer.run`` (no evaluation before, one tiny
    one after, no kill switch; ``seconds``: the run's clock stops it after the step that
    passes it): median seconds of the steps after the second, split by phase; the GPU's
    busy share over the second (profiled); the peak memory of each phase and of the run."""
    import torch

    from composer_replication.config.run import RunConfig
    from composer_replication.safety import CollapseStopError
    from composer_replication.training.loop import Trainer

    config = RunConfig.from_toml(
        config_path,
        [
            f"model.source={source}",
            f"model.device={device}",
            f"output_dir={where}",
            f"steps={steps}",
            "eval.at_start=false",
            "eval.max_tasks=1",
            "eval.samples_per_task=1",
            "eval.greedy=false",
            "guard.enabled=false",
            "checkpoint.every=1000000",
            *([f"max_wall_seconds={seconds}"] if seconds else []),
            *overrides,
        ],
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    phases = PhasePeaks(device)
    (env_config,) = config.envs
    env = benchmark_env(dict(env_config.options), reward_seed, phases)
    trainer = Trainer(config, console=None, run_dir=where, environments={env_config.name: env})
    trainer.learner.update = phases.wrap(trainer.learner.update, "train")
    observer = StepObserver(trainer, device, table=table)
    with contextlib.suppress(CollapseStopError):  # switched off; a run that stops is data
        trainer.run()
    rows = observer.rows
    if not rows:
        raise RuntimeError("the run took no step")
    timed = rows[2:] or rows[1:] or rows

    def median(key: str) -> float:
        return statistics.median(float(r.get(key, 0.0)) for r in timed)

    sample = median("time/generate_s")
    collect = median("time/generate_score_s")
    parts: dict[str, list[float]] = {}
    for row in timed:
        for name, value in component_tokens(row).items():
            parts.setdefault(name, []).append(value)
    return {
        "async_level": getattr(trainer, "async_level", config.inference.async_level),
        "steps": len(rows),
        "timed_steps": len(timed),
        "step_s": median("time/step_s"),
        "sample_s": sample,
        "grade_score_s": max(0.0, collect - sample),
        "train_s": median("time/train_s"),
        "wait_rollouts_s": median("time/wait_rollouts_s"),
        "sampled_tokens": median("tokens/sampled"),
        "train_tokens": median("tokens/total"),
        "component_tokens": {k: statistics.median(v) for k, v in parts.items()},
        "reward_mean": median("reward/mean"),
        "first_step_s": float(rows[0].get("time/step_s", 0.0)),
        **observer.busy,
        "peak_bytes": phases.result(),
        "run_peak_bytes": torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else None,
    }


def async_overrides(level: int) -> list[str] | str:
    """The overrides that set ``[inference] async_level`` to ``level``, or why this build's
    config refuses it (with the in-process engine)."""
    from composer_replication.config.run import RunConfig

    override = f"inference.async_level={level}"
    try:
        config = RunConfig.from_toml(GPU_RECIPE, [override])
    except Exception as err:  # pydantic's ValidationError: the build cannot sample ahead
        return f"{' '.join(str(err).split())}"[:300]
    if config.inference.async_level != level:
        return f"the config reads async_level = {config.inference.async_level!r}"
    return [override]


def section_steps(
    args: argparse.Namespace,
    source: str,
    device: Any,
    where: Path,
    shares: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The composer recipe (gpu.toml) at async_level 0 and 1 (and, without ``--all``, the
    default recipe at 0); ``shares``: seconds for each run (``steps_async_0``, ...), its
    clock (``max_wall_seconds``) started with the run."""
    steps = min(args.steps, 3) if args.quick else args.steps  # warm-up, profiled, timed
    recipes: dict[str, Path] = {"composer": GPU_RECIPE}
    if not args.all:
        recipes["default"] = ROOT / "configs/runs/default.toml"
    out: dict[str, Any] = {}
    for recipe, path in recipes.items():
        out[recipe] = {}
        for level in (0, 1) if recipe == "composer" else (0,):
            key = f"async_{level}"
            overrides = async_overrides(level)
            if isinstance(overrides, str):
                out[recipe][key] = {"unavailable": overrides}
                log(f"  step {recipe} {key}: not available in this build ({overrides[:120]})")
                continue
            seconds = (shares or {}).get(f"steps_{key}")
            table = None if args.profile is None else args.profile / f"step_{recipe}_{key}.txt"
            log(f"  step {recipe} {key}: {steps} steps" + (f", {seconds:.0f} s" if seconds else ""))
            try:
                result = recipe_run(
                    path,
                    source,
                    device,
                    steps=steps,
                    overrides=overrides + (QUICK_STEP_OVERRIDES if args.quick else []),
                    where=where / f"{recipe}_{key}",
                    reward_seed=REWARD_SEED if args.random_weights else None,
                    seconds=seconds,
                    table=table,
                )
                out[recipe][key] = result
                parts = said_tokens(result["component_tokens"])
                log(
                    f"  step {recipe} {key}: {result['step_s']:.2f} s = sample "
                    f"{result['sample_s']:.2f} + grade {result['grade_score_s']:.2f} + train "
                    f"{result['train_s']:.2f}; GPU busy {_share(result.get('gpu_busy_kernels'))}"
                    f" (NVML {_share(result.get('gpu_busy_nvml'))}); tokens: {parts}"
                )
            except Exception as err:
                out[recipe][key] = failure(err)
                log(f"  step {recipe} {key} failed: {out[recipe][key]['error']}")
                if args.debug:
                    traceback.print_exc()
    return out


def memory_summary(results: dict[str, Any], device: Any) -> dict[str, Any]:
    """Peak bytes of each phase of the composer step (async_level 0) and of each whole
    composer run (the sampling-ahead one holds a second copy of the weights), beside the
    card's size; None on a CPU."""
    import torch

    peaks: dict[str, Any] = {}
    composer = results.get("steps", {}).get("composer", {})
    sync = composer.get("async_0", {})
    for phase, value in (sync.get("peak_bytes") or {}).items():
        peaks[phase] = value
    for key, run in composer.items():
        if isinstance(run, dict) and "run_peak_bytes" in run:
            peaks[f"{key} run"] = run["run_peak_bytes"]
    card = None
    if device.type == "cuda":
        card = torch.cuda.get_device_properties(device).total_memory
    return {"peak_bytes": peaks, "card_bytes": card}


# --------------------------------------------------------------------------- held-out


def heldout_runs(
    args: argparse.Namespace, source: str, minutes: float, algorithms: list[str], where: Path
) -> dict:
    """gpu.toml with each algorithm for ``minutes`` (the run's clock, its first evaluation
    included): greedy and sampled held-out pass@1 before and after."""
    from composer_replication.config.run import RunConfig
    from composer_replication.training.loop import Trainer

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
            config = RunConfig.from_toml(GPU_RECIPE, overrides)
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
            out[algorithm] = failure(err)
            log(f"  held-out {algorithm} failed: {out[algorithm]['error']}")
            if args.debug:
                traceback.print_exc()
    return out


# --------------------------------------------------------------------------- tables


def _cell(entry: dict | None, key: str = "tokens_s") -> str:
    if not entry:
        return "-"
    if "error" in entry:
        return "failed"
    return f"{entry[key]:,.0f}"


def _share(value: Any) -> str:
    return f"{value:.0%}" if isinstance(value, (int, float)) else "n/a"


def _gb(value: Any) -> str:
    return f"{value / 1e9:.1f} GB" if isinstance(value, (int, float)) else "n/a"


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
        lines += [
            f"Training, tokens/s ({train['tokens']:,} tokens of {train['rollouts']} synthetic "
            f"rollouts, micro-batches of <= {train['token_budget']:,}):",
            "| step | tokens/s | seconds | micro-batches | tokens per component | peak |",
            "|---|---|---|---|---|---|",
        ]
        for name, label in (
            ("plain", "plain forward+backward+AdamW"),
            ("rl", "learner, rl only"),
            ("composer", "learner, composer (rl+jsd+dpo)"),
        ):
            r = train.get(name)
            if not r or "error" in r:
                lines.append(f"| {label} | {(r or {}).get('error', '-')[:80]} |||||")
                continue
            parts = said_tokens(r.get("component_tokens", {}))
            lines.append(
                f"| {label} | {r['tokens_s']:,.0f} | {r['seconds']:.2f} | {r['micro_batches']} "
                f"| {parts} | {_gb(r.get('peak_bytes'))} |"
            )
        lines.append("")
    steps = results.get("steps", {})
    if steps and "error" not in steps:
        lines += [
            "Seconds per step (median after the second; the second is profiled):",
            "| recipe | async | step | sample | grade+score | train | sampled tokens | "
            "tokens per component | GPU busy (kernels) | NVML |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, runs in steps.items():
            for key, r in runs.items():
                level = key.removeprefix("async_")
                if "unavailable" in r:
                    lines.append(f"| {name} | {level} | not available in this build |||||||")
                    continue
                if "error" in r:
                    lines.append(f"| {name} | {level} | failed: {r['error'][:80]} |||||||")
                    continue
                parts = said_tokens(r["component_tokens"])
                lines.append(
                    f"| {name} | {level} | {r['step_s']:.2f} | {r['sample_s']:.2f} | "
                    f"{r['grade_score_s']:.2f} | {r['train_s']:.2f} | "
                    f"{r['sampled_tokens']:,.0f} | {parts} | "
                    f"{_share(r.get('gpu_busy_kernels'))} | {_share(r.get('gpu_busy_nvml'))} |"
                )
        lines.append("")
    memory = results.get("memory")
    if memory:
        peaks = ", ".join(f"{k} {_gb(v)}" for k, v in memory["peak_bytes"].items())
        lines += [f"Peak GPU memory: {peaks or 'n/a'} (card: {_gb(memory['card_bytes'])})", ""]
    for key in ("heldout", "ablation"):
        runs = results.get(key)
        if not runs:
            continue
        lines += [
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
        lines.append("")
    if "goals" in results:
        lines += ["Goals:", goals_table(results["goals"]), ""]
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


# --------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument(
        "--all",
        action="store_true",
        help="measure every goal within --budget seconds and print the goals table",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=480.0,
        metavar="SECONDS",
        help="--all: seconds for the whole run, shared among its parts (default 480)",
    )
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="with --random-weights: a directory holding SmolLM2's tokenizer files "
        "(default: the embedded model's)",
    )
    parser.add_argument("--quick", action="store_true", help="a small model: a dry run")
    parser.add_argument(
        "--sections",
        default=None,
        help="without --all: some of sampling,train,steps,compiled (default: all four)",
    )
    parser.add_argument("--steps", type=int, default=4, help="steps per run (>= 2)")
    parser.add_argument("--heldout", type=float, default=0.0, metavar="MINUTES")
    parser.add_argument("--ablation", type=float, default=0.0, metavar="MINUTES")
    parser.add_argument("--json", type=Path, default=None, help="the results as JSON here")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write DIR/gpu.json (results and goal rows) and DIR/gpu.md (the tables)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="steps: the profiled step's operator tables to DIR",
    )
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.random_weights = True
    valid = ("sampling", "train", "steps", "compiled")
    if args.all and args.sections is not None:
        refuse("--sections", repr(args.sections), "--all measures its own parts; leave one out")
    args.sections = check_choices(args.sections or ",".join(valid), "--sections", valid)
    check_count(args.steps, "--steps", minimum=2, what="steps", why="the first compiles")
    check_number(args.budget, "--budget", above=True, what="seconds")
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
    args.out = checked_output(args.out, "--out", directory=True)
    args.profile = checked_output(args.profile, "--profile", directory=True)
    return args


def run_sections(
    args: argparse.Namespace, results: dict[str, Any], source: str, device: Any, where: Path
) -> None:
    """Each section in turn (a failing one is recorded, the others still run); with
    ``--all`` the goal parts, each with its share of ``--budget``."""
    import torch

    if args.all:
        sections = ["sampling", "train", "steps"]
        shares = {part: args.budget * share for part, share in SHARES.items()}
    else:
        sections, shares = args.sections, {}

    def budget(part: str) -> PartBudget | None:
        """The part's budget, its clock started now."""
        return PartBudget(shares[part]) if part in shares else None

    started = time.perf_counter()
    for section in sections:
        log(f"[{section}] ({time.perf_counter() - started:.0f} s into the run)")
        start = time.perf_counter()
        try:
            if section == "sampling" and args.all:  # the goal: batch 64, graphs vs generate
                batch = 4 if args.quick else 64
                sides = ("hf", "static_graphs")
                found = section_sampling(args, source, device, (batch,), sides, budget("sampling"))
                merge(results, "sampling", {**found, "goal_batch": batch})
            elif section == "sampling":  # compiled: its own section (compilation time)
                sides = ("hf", "general", "static_eager", "static_graphs")
                batches = (2, 4) if args.quick else (8, 64, 256)
                merge(results, "sampling", section_sampling(args, source, device, batches, sides))
            elif section == "compiled":
                batches = (2, 4) if args.quick else (8, 64, 256)
                found = section_sampling(args, source, device, batches, ("static_compiled",))
                merge(results, "sampling", found)
            elif section == "train":
                results[section] = section_train(args, source, device, budget("train"))
            elif section == "steps":
                seconds = {k: v for k, v in shares.items() if k.startswith("steps_")}
                results[section] = section_steps(args, source, device, where / "runs", seconds)
                results["memory"] = memory_summary(results, device)
            else:
                raise ValueError(f"unknown section {section!r}")
        except Exception as err:
            results[section] = failure(err)
            log(f"  {section} failed: {results[section]['error']}")
            if args.debug:
                traceback.print_exc()
        log(f"  ({time.perf_counter() - start:.0f} s)")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_results(args, results)


def write_results(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The results so far (and the goal rows) to --json and --out."""
    results["goals"] = evaluate_goals(results)
    if args.json:
        write_json(args.json, results)
    if args.out:
        from composer_replication.common.atomic_io import write_text_atomic

        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "gpu.json", results)
        write_text_atomic(args.out / "gpu.md", table(results) + "\n")


def main() -> None:
    args = parse_args()
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
    measured = device.type == "cuda" and not args.quick
    results: dict[str, Any] = {
        "machine": f"{name}; {machine_line()}",
        "device": device.type,
        "measured": measured,
        "dry_run": "on CPU" if device.type != "cuda" else "(--quick)",
        "random_weights": args.random_weights,
        "budget_s": args.budget if args.all else None,
    }
    log(results["machine"])
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        source = make_model_dir(args, where)
        run_sections(args, results, source, device, where)
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
    results["wall_s"] = time.perf_counter() - start
    write_results(args, results)
    print()
    print(table(results))
    if args.out:
        log(f"wrote {args.out / 'gpu.json'} and {args.out / 'gpu.md'}")


if __name__ == "__main__":
    main()
