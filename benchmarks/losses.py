"""Loss-library benchmark: our losses vs trl and vs the naive full-logits path.

Run: ``python benchmarks/losses.py`` (about 5 minutes on 2 CPU cores; ``--quick`` shrinks
the sizes for a smoke run). Every implementation runs in a fresh process on identical
inputs (same seeds), and the report prints time and peak-extra-memory ratios.

(a) ``generalized_jsd_loss`` (ours, chunked, analytic backward) vs trl's
    ``GKDTrainer.generalized_jsd_loss`` on (B, T, V) logits, forward + backward.
(b) per-token log-prob, cross-entropy and JSD computed from hidden states and the LM head
    in token chunks vs the naive path (full logits -> log_softmax -> gather), with the head
    weight trained (full fine-tune) and frozen (LoRA).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_choices, check_count, gib, machine_line, measure, refuse, run_case

FULL = {"B": 4, "T": 1024, "V": 49152, "H": 576}
QUICK = {"B": 2, "T": 256, "V": 49152, "H": 576}


# ----------------------------------------------------------------------------- workers


def _make_logits(B: int, T: int, V: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.empty(B, T, V)
    x.normal_(generator=gen).mul_(2.0)  # in place: no set-up temporaries
    return x


def _labels(B: int, T: int, V: int):
    import torch

    gen = torch.Generator().manual_seed(7)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[:, : T // 8] = -100  # a prompt prefix, as in distillation batches
    return labels


def worker_jsd(impl: str, B: int, T: int, V: int, **_: int) -> dict:
    import torch

    torch.manual_seed(0)
    student = _make_logits(B, T, V, 1).requires_grad_()
    teacher = _make_logits(B, T, V, 2)
    labels = _labels(B, T, V)
    if impl == "trl":
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.gkd import GKDTrainer

        fn = GKDTrainer.generalized_jsd_loss
    else:
        from composer_replication.opsd import generalized_jsd_loss as fn

    timings = {}

    def step() -> dict:
        t0 = time.perf_counter()
        loss = fn(student, teacher, labels, beta=0.5, temperature=0.9)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        timings.update(forward_s=t1 - t0, backward_s=t2 - t1)
        return {"value": float(loss)}

    out = measure(step)
    out.update(timings)
    out["grad_norm"] = float(student.grad.double().norm())
    return out


def worker_hidden(
    impl: str, op: str, head_grad: bool, B: int, T: int, V: int, H: int, repeats: int = 3
) -> dict:
    import torch

    from composer_replication.chunked_head import (
        cross_entropy_from_hidden,
        jsd_from_hidden,
        token_logprobs_from_hidden,
    )

    gen = torch.Generator().manual_seed(0)
    N = B * T
    hidden = torch.randn(N, H, generator=gen).requires_grad_()
    weight = torch.randn(V, H, generator=gen).mul_(0.05).requires_grad_(head_grad)
    teacher_hidden = torch.randn(N, H, generator=gen)
    targets = torch.randint(0, V, (N,), generator=gen)
    upstream = torch.randn(N, generator=gen)  # an arbitrary downstream loss on per-token values

    def naive() -> torch.Tensor:
        logits = hidden @ weight.T
        if op == "ce":
            return torch.nn.functional.cross_entropy(logits, targets)
        logp = torch.log_softmax(logits, dim=-1)
        if op == "logprobs":
            return (logp.gather(-1, targets[:, None]).squeeze(-1) * upstream).sum()
        with torch.no_grad():
            t_logp = torch.log_softmax(teacher_hidden @ weight.T, dim=-1)
        mix = torch.logaddexp(logp + math.log(0.5), t_logp + math.log(0.5))
        jsd = 0.5 * (t_logp.exp() * (t_logp - mix)).sum(-1) + 0.5 * (logp.exp() * (logp - mix)).sum(
            -1
        )
        return (jsd * upstream).sum()

    def ours() -> torch.Tensor:
        if op == "ce":
            return cross_entropy_from_hidden(hidden, weight, targets)
        if op == "logprobs":
            return (token_logprobs_from_hidden(hidden, weight, targets) * upstream).sum()
        return (jsd_from_hidden(hidden, weight, teacher_hidden, beta=0.5) * upstream).sum()

    fn = naive if impl == "naive" else ours

    def step() -> dict:
        loss = fn()
        loss.backward()
        return {"value": float(loss)}

    first = measure(step)  # the peak-memory reading comes from the first, cold call
    seconds = [first["seconds"]]
    for _ in range(repeats - 1):
        hidden.grad = None
        weight.grad = None
        seconds.append(measure(step, cold=False)["seconds"])
    first["seconds"] = sorted(seconds)[len(seconds) // 2]
    first["grad_norm"] = float(hidden.grad.double().norm())
    if head_grad:
        first["head_grad_norm"] = float(weight.grad.double().norm())
    return first


# ----------------------------------------------------------------------------- report


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--skip-trl", action="store_true", help="skip part (a)'s trl run")
    parser.add_argument("--parts", default="ab", help="which parts to run: a, b or ab")
    parser.add_argument("--ops", default="logprobs,ce,jsd", help="part (b) ops, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case (median)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--args", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        kwargs = json.loads(ns.args)
        result = worker_jsd(**kwargs) if ns.worker == "jsd" else worker_hidden(**kwargs)
        print(json.dumps(result))
        return
    if not ns.parts or set(ns.parts) - {"a", "b"}:
        refuse("--parts", repr(ns.parts), "use a, b or ab")
    ops = check_choices(ns.ops, "--ops", ("logprobs", "ce", "jsd"))
    check_count(ns.repeats, "--repeats", what="timed calls")

    sizes = QUICK if ns.quick else FULL
    script = os.path.abspath(__file__)
    print(f"machine: {machine_line()}")
    print(f"sizes: B={sizes['B']} T={sizes['T']} V={sizes['V']} H={sizes['H']}\n")

    if "a" in ns.parts:
        _part_a(script, sizes, ns.skip_trl)
    if "b" in ns.parts:
        _part_b(script, sizes, ops, ns.repeats)


def _part_a(script: str, sizes: dict, skip_trl: bool) -> None:
    print("(a) generalized_jsd_loss, beta=0.5, temperature=0.9, forward + backward")
    ours = run_case(script, "jsd", {"impl": "ours", **sizes})
    print(
        f"  ours: fwd {ours['forward_s']:.2f} s  bwd {ours['backward_s']:.2f} s  "
        f"peak extra {gib(ours['peak_extra_bytes'])}"
    )
    if not skip_trl:
        trl = run_case(script, "jsd", {"impl": "trl", **sizes})
        print(
            f"  trl : fwd {trl['forward_s']:.2f} s  bwd {trl['backward_s']:.2f} s  "
            f"peak extra {gib(trl['peak_extra_bytes'])}"
        )
        time_ratio = ours["seconds"] / trl["seconds"]
        mem_ratio = ours["peak_extra_bytes"] / max(trl["peak_extra_bytes"], 1)
        print(
            f"  ratio ours/trl: time {time_ratio:.3f}x (goal <= 0.30x)  "
            f"peak extra memory {mem_ratio:.3f}x (goal <= 0.15x)"
        )
        print(
            f"  value |diff| {abs(ours['value'] - trl['value']):.2e}  "
            f"grad-norm rel diff {_rel(ours['grad_norm'], trl['grad_norm']):.1e}"
        )


def _part_b(script: str, sizes: dict, ops: list[str], repeats: int) -> None:
    head_bytes = sizes["V"] * sizes["H"] * 4
    print("\n(b) from hidden states + LM head: chunked (ours) vs naive full logits")
    for head_grad in (True, False):
        label = "head trained (full fine-tune)" if head_grad else "head frozen (LoRA)"
        print(f"  {label}")
        for op in ops:
            common = {"op": op, "head_grad": head_grad, "repeats": repeats, **sizes}
            naive = run_case(script, "hidden", {"impl": "naive", **common})
            mine = run_case(script, "hidden", {"impl": "ours", **common})
            print(
                f"    {op:8s} time {mine['seconds']:.2f}/{naive['seconds']:.2f} s = "
                f"{mine['seconds'] / naive['seconds']:.3f}x (goal <= 1.0x)  peak extra "
                f"{gib(mine['peak_extra_bytes'])}/{gib(naive['peak_extra_bytes'])} = "
                f"{mine['peak_extra_bytes'] / max(naive['peak_extra_bytes'], 1):.3f}x "
                f"(goal <= 0.05x)  value rel diff {_rel(mine['value'], naive['value']):.1e}  "
                f"grad rel diff {_rel(mine['grad_norm'], naive['grad_norm']):.1e}"
            )
            if head_grad:  # both paths must return the head's (V, H) gradient
                mine_x = mine["peak_extra_bytes"] - head_bytes
                naive_x = naive["peak_extra_bytes"] - head_bytes
                print(
                    f"    {'':8s} without the {gib(head_bytes)} head gradient both return: "
                    f"{gib(mine_x)}/{gib(naive_x)} = {mine_x / max(naive_x, 1):.3f}x"
                )


if __name__ == "__main__":
    main()
