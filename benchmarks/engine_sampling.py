"""Sampling the policy in process (``rollout.generate``) vs through the vLLM engine
(``inference.EngineSampler``), side by side.

Run: ``python benchmarks/engine_sampling.py`` after ``make vllm-env`` (the engine starts
first: ~35 s at ``-O 0``, about a minute more at the default ``-O 2``, which compiles).
SmolLM2-135M-Instruct, prompts of the ``python_functions`` bank as the environment renders
them, its stop string, batch 8 (the train step's 2 tasks x 4 samples) x ``--max-new-tokens``
80, temperature 1. Both sides sample the same prompts, alternating, each timed
``--repeats`` times (median). Printed: kept tokens per second of each side, the ratio, and
the largest |reported log-prob - full forward| of each side (what the trainer recomputes).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import machine_line
from sampling import ours, recompute_gap, timed

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimization-level", type=int, default=2)
    parser.add_argument("--engine-python", default=str(ROOT / ".venv-vllm/bin/python"))
    ns = parser.parse_args()

    import torch

    from composer_replication.config.inference import InferenceConfig
    from composer_replication.envs.python_functions import STOP_STRINGS, PythonFunctionsEnv
    from composer_replication.inference.engine import PolicyEngine
    from composer_replication.models import embedded_model_dir, load_policy
    from composer_replication.rollout.generate import SamplingSettings

    torch.set_num_threads(ns.threads)
    model, tok = load_policy(None)
    model.eval()
    env = PythonFunctionsEnv()
    task_ids = env.task_ids()
    n_tasks = max(1, ns.batch // 4)
    prompts = [env.prompt_ids(tok, env.tasks[t]) for t in task_ids[:n_tasks] for _ in range(4)]
    prompts = prompts[: ns.batch]
    settings = SamplingSettings(
        max_new_tokens=ns.max_new_tokens, temperature=1.0, stop_strings=STOP_STRINGS
    )
    config = InferenceConfig(
        engine="vllm",
        python=ns.engine_python,
        optimization_level=ns.optimization_level,
        max_model_len=2048,
    )
    print(f"machine: {machine_line()}; torch threads {ns.threads}")
    with tempfile.TemporaryDirectory() as run_dir:
        engine = PolicyEngine(config, model_dir=embedded_model_dir(), run_dir=run_dir, seed=0)
        with engine:
            t0 = time.perf_counter()
            sampler = engine.sampler
            print(f"engine start (-O {ns.optimization_level}): {time.perf_counter() - t0:.1f} s")
            sampler.sample_batch(tok, prompts[:1], settings)  # first request warms up
            engine_s, engine_rows = timed(
                lambda: [
                    (g.completion_ids, g.logprobs)
                    for g in sampler.sample_batch(tok, prompts, settings)
                ],
                ns.repeats,
                0,
            )
    # the in-process side runs after the server has stopped: its idle workers must not
    # share the cores with it
    ours_s, our_rows = timed(lambda: ours(model, tok, prompts, settings), ns.repeats, 0)
    engine_tok = sum(len(t) for t, _ in engine_rows)
    our_tok = sum(len(t) for t, _ in our_rows)
    print(
        f"batch {len(prompts)} x {ns.max_new_tokens} tokens, T=1: in process "
        f"{our_tok / ours_s:6.1f} tok/s ({our_tok} tok, {ours_s:.2f} s), engine "
        f"{engine_tok / engine_s:6.1f} tok/s ({engine_tok} tok, {engine_s:.2f} s): engine/in "
        f"process {engine_tok / engine_s / (our_tok / ours_s):.2f}x; |log-prob - full forward| "
        f"max: in process {recompute_gap(model, prompts, our_rows, 1.0):.1e}, engine "
        f"{recompute_gap(model, prompts, engine_rows, 1.0):.1e}",
        flush=True,
    )


if __name__ == "__main__":
    main()
