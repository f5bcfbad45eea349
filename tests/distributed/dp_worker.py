"""Worker of the data-parallel tests: one rank (or the single reference process) runs two
real optimizer steps of the trainer step on the tiny model and saves its parameters."""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))


def samples():
    # the composer recipe's three components: 7 rl samples of different lengths and
    # advantages, one jsd sample and one DPO pair; the ranks get 5 and 4 samples that pack
    # into different numbers of micro-batches, one rank alone runs the jsd teacher forward
    # and the other the pair forwards
    from test_step import _jsd_sample, _pair, _rl_sample

    from composer_replication.samples.wire import TrainingSample

    rl = [
        _rl_sample(10 + i, n_prompt=3 + i % 3, n_completion=4 + 3 * i, adv=0.5 - 0.3 * i)
        for i in range(7)
    ]
    return [*rl, _jsd_sample(30), TrainingSample([], [], [], dpo=_pair(40))]


def build_policy(lora: bool):
    from composer_replication.model.loading import tiny_model

    model = tiny_model(seed=0)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(
            model,
            LoraConfig(
                r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
            ),
        )
    return model


def run(rank: int, world: int, port: int, lora: bool, out: str, die_at: int = -1) -> None:
    from composer_replication.distributed import (
        join_local_group,
        shard_policy,
        sum_counts_over_ranks,
    )
    from composer_replication.distributed.fsdp import GatheredWeights, NoSharding
    from composer_replication.samples.wire import pack_samples
    from composer_replication.training.step import train_step

    torch.set_num_threads(1)
    policy = build_policy(lora)
    # the frozen initial policy scores the DPO pair's reference log-probs (never sharded)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    reducer = None
    weights = NoSharding()
    mine = samples()
    if world > 1:
        group = join_local_group(rank, world, port, torch.device("cpu"), timeout_s=60)
        assert (group.rank, group.world_size) == (rank, world)
        shard_policy(policy)
        weights = GatheredWeights(policy)
        reducer = sum_counts_over_ranks
        mine = group.share(mine)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for step in range(2):
        if step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a rank lost mid-run
        optimizer.zero_grad(set_to_none=True)
        # small micro-batches: gradient accumulation over several backward passes
        batches = pack_samples(mine, max_tokens=24, split=None)
        with weights.accumulating():
            metrics = train_step(policy, batches, reference=reference, count_reducer=reducer)
            # global counts on every rank: all three components ran
            assert metrics["tokens/dpo"] == 1 and metrics["tokens/jsd"] > 0 < metrics["tokens/rl"]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    state = {}
    for name, p in policy.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        state[name] = full.detach().clone()
    torch.save(state, f"{out}.rank{rank}")
    shares = [s.input_ids or s.dpo.chosen_ids for s in mine]
    Path(f"{out}.rank{rank}.tasks").write_text(json.dumps(shares))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, port = (int(v) for v in sys.argv[1:4])
    run(rank, world, port, sys.argv[4] == "lora", sys.argv[5], int(sys.argv[6]))
