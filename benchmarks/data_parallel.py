"""Data parallelism: the native trainer step on 1 process vs 2 FSDP2 ranks over gloo.

Run: ``python benchmarks/data_parallel.py`` (a few minutes). SmolLM2-135M-Instruct, full
fine-tune, a global batch of 8 sequences x 256 tokens (grpo-style rl weights), AdamW. One
process trains on the whole batch with both cores; two ranks (one core each) train on half
each, the policy sharded with FSDP2, token counts summed over ranks (the same update).
Each case runs in fresh processes; a warm-up step first (it creates AdamW's state), then the
median of the timed steps.

Printed per case: seconds per step, global train tokens/s and its ratio to one process; per
rank the bytes of the trainable state it keeps between steps (its parameter shards, their
gradients and AdamW's two moments: FSDP2 divides these by the number of ranks) and its peak
resident memory over the run (which adds, during the step, the whole gathered parameters and
unsharded gradients: see docs/benchmarks.md for the formula at 8 GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, gib, machine_line, peak_rss_bytes, rl_samples


def _state_bytes(policy, optimizer) -> int:
    """Bytes this rank keeps between steps: trainable parameter shards, their gradients and
    the optimizer's state tensors (local shards of sharded ones)."""
    import torch

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in policy.parameters():
        if p.requires_grad:
            total += local(p).numel() * p.element_size()
            if p.grad is not None:
                total += local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                total += local(value).numel() * value.element_size()
    return total


def worker(rank: int, world: int, port: int, n_seq: int, seq_len: int, steps: int) -> dict:
    import torch

    from composer_replication.distributed.ranks import RankGroup
    from composer_replication.model.cpu_allocator import set_mmap_threshold
    from composer_replication.model.loading import load_policy
    from composer_replication.samples.wire import pack_samples
    from composer_replication.training.step import train_step

    set_mmap_threshold(256 << 10)  # peak RSS counts live tensors, not the heap's free blocks
    torch.set_num_threads(2 // world)
    torch.manual_seed(0)
    policy, _ = load_policy()
    policy.train()
    ranks, reducer = RankGroup(), None
    if world > 1:
        from composer_replication.distributed import (
            join_local_group,
            shard_policy,
            sum_counts_over_ranks,
        )
        from composer_replication.distributed.fsdp import GatheredWeights

        ranks = join_local_group(rank, world, port, torch.device("cpu"), timeout_s=600)
        shard_policy(policy)
        weights = GatheredWeights(policy)
        reducer = sum_counts_over_ranks
    else:
        from composer_replication.distributed.fsdp import NoSharding

        weights = NoSharding()
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    mine = ranks.share(rl_samples(n_seq, seq_len, policy.config.vocab_size, n_prompt=32))
    batches = pack_samples(mine, max_tokens=2 * seq_len, split=None)

    def step() -> float:
        if world > 1:
            ranks.barrier()  # every rank starts together: the slowest rank sets the time
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with weights.accumulating():
            train_step(policy, batches, count_reducer=reducer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if world > 1:
            ranks.barrier()
        return time.perf_counter() - start

    step()  # warm-up: AdamW creates its state
    times = sorted(step() for _ in range(steps))
    result = {
        "rank": rank,
        "seconds": times[len(times) // 2],
        "state_bytes": _state_bytes(policy, optimizer),
        "peak_rss_bytes": peak_rss_bytes(),
        "tokens": n_seq * seq_len,
    }
    if world > 1:
        torch.distributed.destroy_process_group()
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, args: argparse.Namespace) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(world):
        spec = {"rank": rank, "world": world, "port": port, "n_seq": args.sequences}
        spec.update(seq_len=args.seq_len, steps=args.steps)
        cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
        env = {**os.environ, "OMP_NUM_THREADS": str(2 // world)}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
    results = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"a rank failed:\n{err.decode()[-4000:]}")
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(**json.loads(args.worker))))
        return
    # two ranks share the batch: each needs a sequence; each sequence 32 prompt tokens
    check_count(args.sequences, "--sequences", minimum=2, what="sequences", why="one per rank")
    check_count(args.seq_len, "--seq-len", minimum=33, what="tokens", why="32 of them the prompt")
    check_count(args.steps, "--steps", what="timed steps")
    print(machine_line())
    print(
        f"SmolLM2-135M full fine-tune, global batch {args.sequences} x {args.seq_len} tokens, "
        f"median of {args.steps} steps after a warm-up"
    )
    cases = {world: run_ranks(world, args) for world in (1, 2)}
    one = cases[1][0]
    one_rate = one["tokens"] / one["seconds"]
    print(
        f"{'ranks':>5} {'s/step':>8} {'tokens/s':>9} {'ratio':>6}  per rank: kept state, peak RSS"
    )
    for world, results in cases.items():
        seconds = max(r["seconds"] for r in results)
        rate = args.sequences * args.seq_len / seconds
        kept = ", ".join(gib(r["state_bytes"]) for r in results)
        peak = ", ".join(gib(r["peak_rss_bytes"]) for r in results)
        print(f"{world:>5} {seconds:>8.2f} {rate:>9.1f} {rate / one_rate:>5.2f}x  {kept}; {peak}")
    two = cases[2]
    kept_ratio = max(r["state_bytes"] for r in two) / one["state_bytes"]
    peak_ratio = max(r["peak_rss_bytes"] for r in two) / one["peak_rss_bytes"]
    print(
        f"2 ranks vs 1 process: kept state per rank {kept_ratio:.2f}x, peak RSS per rank "
        f"{peak_ratio:.2f}x, tokens/s {args.sequences * args.seq_len / max(r['seconds'] for r in two) / one_rate:.2f}x"
    )


if __name__ == "__main__":
    main()
