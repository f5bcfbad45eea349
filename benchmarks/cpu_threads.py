"""How CPU worker threads wait: libgomp's default spin against the commands' short spin
(``composer_replication.model.cpu_threads``), side by side in one run.

Run: ``python benchmarks/cpu_threads.py`` (about 5 minutes on 2 CPU cores; ``--rows``,
``--new-tokens``, ``--out`` a JSON). Each case runs in a fresh interpreter (the spin is read
when torch loads) with the embedded model: a greedy decode of ``--rows`` prompts of 128
tokens, ``--new-tokens`` each, and one training forward + backward over 4 x 256 tokens.
Each is timed with the cores to itself ("alone") and beside one process that keeps a core
busy ("beside a busy core", what a sandboxed test run does to the agent loop's decode, or
task generation to a run beside it). Printed: seconds per case and the default / short-spin
ratio (above 1: the short spin is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, check_number, checked_output, machine_line, write_json

SPIN_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def worker(args: dict[str, Any]) -> dict[str, Any]:
    """One case in this (fresh) process: the decode and the training step, timed."""
    import random

    import torch

    from composer_replication.inference.decoding.generate import InProcessSampler, SamplingSettings
    from composer_replication.model.loading import load_policy

    model, tokenizer = load_policy("embedded")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(args["rows"])]
    sampler = InProcessSampler(model)
    settings = SamplingSettings(max_new_tokens=args["new_tokens"], temperature=0.0)
    model.eval()
    sampler.sample_batch(tokenizer, prompts[:1], SamplingSettings(max_new_tokens=2))  # warm
    start = time.perf_counter()
    sampler.sample_batch(tokenizer, prompts, settings)
    decode_s = time.perf_counter() - start
    model.train()
    ids = torch.tensor([[rng.randrange(100, 40000) for _ in range(256)] for _ in range(4)])
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    train_s = time.perf_counter() - start
    return {"decode_s": decode_s, "train_s": train_s}


def run_case(spin: str | None, busy: bool, args: dict[str, Any]) -> dict[str, Any]:
    """A fresh interpreter with the spin setting (None: libgomp's default), beside a busy
    core or alone."""
    env = {k: v for k, v in os.environ.items() if k not in SPIN_VARIABLES}
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    burner = None
    if busy:
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(args)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the case failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker is not None:
        print(json.dumps(worker(json.loads(ns.worker))))
        return
    check_count(ns.rows, "--rows")
    check_count(ns.new_tokens, "--new-tokens")
    check_number(ns.rows, "--rows", maximum=256)
    check_number(ns.new_tokens, "--new-tokens", maximum=4096)
    out = checked_output(ns.out, "--out") if ns.out else None

    from composer_replication.model.cpu_threads import SPIN_COUNT

    print(machine_line())
    args = {"rows": ns.rows, "new_tokens": ns.new_tokens}
    results: list[dict[str, Any]] = []
    print(f"{'where':<20} {'case':<44} {'default spin':>12} {'short spin':>11} {'ratio':>6}")
    for busy in (False, True):
        default = run_case(None, busy, args)
        short = run_case(str(SPIN_COUNT), busy, args)
        where = "beside a busy core" if busy else "alone"
        for key, label in (
            ("decode_s", f"decode {ns.rows} x 128 tokens + {ns.new_tokens} new"),
            ("train_s", "training forward + backward, 4 x 256 tokens"),
        ):
            ratio = default[key] / short[key]
            print(
                f"{where:<20} {label:<44} {default[key]:>11.2f}s {short[key]:>10.2f}s "
                f"{ratio:>5.2f}x"
            )
            results.append(
                {
                    "where": where,
                    "case": key,
                    "default_s": default[key],
                    "short_s": short[key],
                    "ratio": ratio,
                }
            )
    if out is not None:
        write_json(out, {"spin_count": SPIN_COUNT, "results": results})


if __name__ == "__main__":
    main()
