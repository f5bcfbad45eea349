"""Sampling the policy: ours in process (``rollout.generate``) vs transformers' ``generate``,
and vs the vLLM engine (``inference.EngineSampler``), side by side in one run.

Run: ``python benchmarks/sampling.py`` (about 20 minutes; ``--engine`` adds the engine side
after ``make vllm-env``, ``--loop-steps N`` the default job's steps synchronous and with
``async_level = 1``). SmolLM2-135M-Instruct, prompts of the ``python_functions`` bank
rendered as the environment renders them, its stop string, 80 new tokens, temperature 1
, 0.7 and greedy). Two settings, as the training job uses them:

- the train step: 2 tasks x 4 samples = batch 8;
- held-out evaluation: ``--eval-tasks`` tasks x 4 samples; the peer samples in chunks of 16,
  ours in one call with ``--eval-batch`` rows decoding at once (the others join as rows
  finish); the engine takes each setting's prompts in one request.

Ours runs twice, with and without prompt-lookup drafts. All in-process sides sample the
same prompts with the same seed in one process, one after the other, each timed
``--repeats`` times (median); the engine's side runs after them
(its idle workers would otherwise share the cores). Printed per setting: kept tokens per
second of each side and the ratios. Exactness: greedy tokens must be identical with
log-probs within 1e-4; sampled log-probs are compared with a full forward pass over prompt
+ completion (what the trainer computes) and the largest difference is printed.

``--loop-steps N`` then runs the default job (the composer recipe, 2 tasks x 4 samples)
for N steps through the same engine twice, with ``async_level = 0`` and ``= 1``, and prints
the median seconds per step after the first and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, check_input, machine_line, refuse

ROOT = Path(__file__).resolve().parents[1]


def hf_generate(model, tokenizer, prompts, settings, eos_ids):
    """The peer: transformers' ``generate`` with plain temperature sampling; completions cut
    at the first EOS or stop string as ours are."""
    import torch

    from composer_replication.inference.decoding.padding import left_pad

    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    greedy = settings.temperature == 0
    kwargs = {
        "max_new_tokens": settings.max_new_tokens,
        "do_sample": not greedy,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": eos_ids,
        "return_dict_in_generate": True,
        "output_logits": True,
        "top_k": None,
        "top_p": None,
        "min_p": None,
        "repetition_penalty": None,
        "stop_strings": list(settings.stop_strings),
        "tokenizer": tokenizer,
    }
    if not greedy:
        kwargs["temperature"] = settings.temperature
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    new = out.sequences[:, ids.shape[1] :]
    scale = 1.0 if greedy else settings.temperature
    lps = torch.stack([torch.log_softmax(x.float() / scale, -1) for x in out.logits], 1)
    picked = lps.gather(-1, new[:, :, None]).squeeze(-1)
    rows = []
    for r in range(len(prompts)):
        tokens, text = new[r].tolist(), ""
        n = len(tokens)
        for i, tok in enumerate(tokens):
            if tok in eos_ids:
                n = i + 1
                break
            text += tokenizer.decode([tok])
            if any(s in text for s in settings.stop_strings):
                n = i + 1
                break
        rows.append((tokens[:n], picked[r, :n].tolist()))
    return rows


def ours(model, tokenizer, prompts, settings, max_rows=None):
    from composer_replication.inference.decoding.generate import generate

    return [
        (g.completion_ids, g.logprobs)
        for g in generate(model, tokenizer, prompts, settings, max_rows=max_rows)
    ]


def ours_without_drafts(model, tokenizer, prompts, settings, max_rows=None):
    """Our decode loop with prompt-lookup drafts off (one token per row per forward)."""
    import torch

    from composer_replication.inference.decoding.decode import decode_rows
    from composer_replication.inference.decoding.generate import _eos_ids
    from composer_replication.inference.decoding.packed_linear import packed_linears

    with torch.no_grad(), packed_linears(model, batch_hint=min(len(prompts), max_rows or 10**9)):
        rows = decode_rows(
            model,
            prompts,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            eos_ids=_eos_ids(model, tokenizer),
            pad_id=tokenizer.pad_token_id,
            tokenizer=tokenizer,
            stop_strings=settings.stop_strings,
            draft_token_budget=0,
            max_rows=max_rows,
        )
    return [(r.tokens, r.logprobs) for r in rows]


def in_chunks(fn, prompts, size):
    rows = []
    for start in range(0, len(prompts), size):
        rows += fn(prompts[start : start + size])
    return rows


def recompute_gap(model, prompts, rows, temperature) -> float:
    """Largest |reported - full-forward| log-prob over the sampled tokens."""
    import torch

    scale = temperature or 1.0
    worst = 0.0
    for prompt, (tokens, logprobs) in zip(prompts, rows):
        if not tokens:
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / scale, -1)
        ref = lp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        worst = max(worst, (ref - torch.tensor(logprobs)).abs().max().item())
    return worst


def timed(fn, repeats, seed):
    import torch

    times, rows = [], None
    for _ in range(repeats):
        torch.manual_seed(seed)
        start = time.perf_counter()
        rows = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--eval-tasks", type=int, default=32)
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", action="store_true", help="add the vLLM engine's side")
    parser.add_argument("--loop-steps", type=int, default=0, help="default-job steps (engine)")
    parser.add_argument("--optimization-level", type=int, default=2)
    parser.add_argument("--engine-python", default=str(ROOT / ".venv-vllm/bin/python"))
    ns = parser.parse_args()
    from composer_replication.envs.python_functions import PythonFunctionsEnv

    check_count(ns.max_new_tokens, "--max-new-tokens", what="tokens")
    check_count(ns.eval_tasks, "--eval-tasks", what="tasks")
    bank = len(PythonFunctionsEnv().task_ids())
    if ns.eval_tasks > bank:
        refuse("--eval-tasks", ns.eval_tasks, f"give at most {bank} (the python_functions bank)")
    check_count(ns.eval_batch, "--eval-batch", what="rows")
    check_count(ns.repeats, "--repeats", what="timed repeats")
    check_count(ns.threads, "--threads", what="threads")
    check_count(ns.loop_steps, "--loop-steps", minimum=0, what="steps", why="0: none")
    if not 0 <= ns.optimization_level <= 3:
        refuse("--optimization-level", ns.optimization_level, "use 0, 1, 2 or 3 (vLLM's -O)")
    if ns.engine or ns.loop_steps:
        check_input(ns.engine_python, "--engine-python")

    import torch

    from composer_replication.envs.python_functions import STOP_STRINGS
    from composer_replication.inference.decoding.generate import SamplingSettings, _eos_ids
    from composer_replication.model.loading import load_policy

    torch.set_num_threads(ns.threads)
    model, tok = load_policy(None)
    model.eval()
    env = PythonFunctionsEnv()
    task_ids = env.task_ids()
    eos = _eos_ids(model, tok)

    def prompts_for(n_tasks):
        return [env.prompt_ids(tok, env.tasks[t]) for t in task_ids[:n_tasks] for _ in range(4)]

    print(f"machine: {machine_line()}; torch threads {ns.threads}")
    # (name, prompts, the peer's prompts per call, our rows decoding at once: one call)
    cases = [
        ("train step, batch 8", prompts_for(2), 8, None),
        (
            f"evaluation, {ns.eval_tasks}x4 (peer 16/call, ours one call, "
            f"{ns.eval_batch} rows at once)",
            prompts_for(ns.eval_tasks),
            16,
            ns.eval_batch,
        ),
    ]
    ours_rate = {}
    for temperature in (1.0, 0.7, 0.0):
        settings = SamplingSettings(
            max_new_tokens=ns.max_new_tokens, temperature=temperature, stop_strings=STOP_STRINGS
        )
        for name, prompts, peer_batch, our_rows_at_once in cases:
            peer_s, peer_rows = timed(
                lambda p=prompts, b=peer_batch, s=settings: in_chunks(
                    lambda c: hf_generate(model, tok, c, s, eos), p, b
                ),
                ns.repeats,
                0,
            )
            plain_s, plain_rows = timed(
                lambda p=prompts, s=settings, m=our_rows_at_once: ours_without_drafts(
                    model, tok, p, s, m
                ),
                ns.repeats,
                0,
            )
            our_s, our_rows = timed(
                lambda p=prompts, s=settings, m=our_rows_at_once: ours(model, tok, p, s, m),
                ns.repeats,
                0,
            )
            peer_rate = sum(len(t) for t, _ in peer_rows) / peer_s
            plain_rate = sum(len(t) for t, _ in plain_rows) / plain_s
            our_tok = sum(len(t) for t, _ in our_rows)
            line = (
                f"T={temperature:g} {name}: peer {peer_rate:6.1f} tok/s, ours without drafts "
                f"{plain_rate:6.1f} tok/s ({plain_rate / peer_rate:.2f}x), ours "
                f"{our_tok / our_s:6.1f} tok/s ({our_tok} tok, {our_s:.2f} s): "
                f"{our_tok / our_s / peer_rate:.2f}x"
            )
            if temperature == 0:
                same = sum(a[0] == b[0] for a, b in zip(peer_rows, our_rows))
                gap = max(
                    (max((abs(x - y) for x, y in zip(a[1], b[1])), default=0.0))
                    for a, b in zip(peer_rows, our_rows)
                    if a[0] == b[0]
                )
                line += (
                    f"; greedy rows identical {same}/{len(prompts)}, max log-prob diff {gap:.1e}"
                )
            else:
                line += (
                    f"; |log-prob - full forward| max: ours {recompute_gap(model, prompts, our_rows, temperature):.1e}, "
                    f"peer {recompute_gap(model, prompts, peer_rows, temperature):.1e}"
                )
            print(line, flush=True)
            ours_rate[(temperature, name)] = (our_tok / our_s, prompts, settings)
    if ns.engine or ns.loop_steps:
        engine_side(ns, model, tok, ours_rate)


def engine_side(ns, model, tok, ours_rate) -> None:
    """The same settings through the engine, then the default job's steps (see the doc)."""
    import tempfile

    from composer_replication.config.inference import VllmInferenceConfig
    from composer_replication.inference.engine import PolicyEngine
    from composer_replication.model.loading import embedded_model_dir

    config = VllmInferenceConfig(
        python=ns.engine_python,
        optimization_level=ns.optimization_level,
        max_model_len=2048,
    )
    with (
        tempfile.TemporaryDirectory() as run_dir,
        PolicyEngine(config, model_dir=embedded_model_dir(), run_dir=run_dir, seed=0) as eng,
    ):
        t0 = time.perf_counter()
        sampler = eng.sampler
        print(f"engine start (-O {ns.optimization_level}): {time.perf_counter() - t0:.1f} s")
        first = next(iter(ours_rate.values()))
        sampler.sample_batch(tok, first[1][:1], first[2])  # the first request warms up
        for (temperature, name), (rate, prompts, settings) in ours_rate.items():
            engine_s, rows = timed(
                lambda p=prompts, st=settings: [
                    (g.completion_ids, g.logprobs) for g in sampler.sample_batch(tok, p, st)
                ],
                ns.repeats,
                0,
            )
            n_tok = sum(len(t) for t, _ in rows)
            print(
                f"T={temperature:g} {name}: engine {n_tok / engine_s:6.1f} tok/s ({n_tok} "
                f"tok, {engine_s:.2f} s) vs ours in process {rate:6.1f} tok/s: "
                f"{n_tok / engine_s / rate:.2f}x; |log-prob - full forward| max "
                f"{recompute_gap(model, prompts, rows, temperature):.1e}",
                flush=True,
            )
        if ns.loop_steps:
            loop_steps(ns.loop_steps, eng.server.base_url)


def loop_steps(steps: int, url: str) -> None:
    """The default job through the running engine, synchronous and one step ahead."""
    import tempfile

    from composer_replication.config.run import RunConfig
    from composer_replication.training.loop import train

    per_step = {}
    for level in (0, 1):
        with tempfile.TemporaryDirectory() as out:
            config = RunConfig.default(
                [
                    f"steps={steps}",
                    f"output_dir={out}",
                    "eval.at_start=false",
                    f"eval.every={steps + 1}",
                    f"checkpoint.every={steps + 1}",
                    "inference.engine=vllm",
                    f"inference.url={url}",
                    f"inference.async_level={level}",
                ]
            )
            result = train(config)
        rows = [r for r in result.metrics if "time/step_s" in r]
        times = [r["time/step_s"] for r in rows[1:]] or [rows[0]["time/step_s"]]
        per_step[level] = statistics.median(times)
        waits = [r.get("time/wait_rollouts_s", 0.0) for r in rows[1:]]
        print(
            f"default job, async_level={level}: {per_step[level]:.1f} s/step (median of steps "
            f"2-{steps}; sampling+grading waited for {statistics.median(waits or [0.0]):.1f} s)",
            flush=True,
        )
    print(f"async_level=1 vs synchronous: {per_step[0] / per_step[1]:.2f}x steps/s")


if __name__ == "__main__":
    main()
