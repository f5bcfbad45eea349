"""Monarch actors on their own: teacher replay in an actor process, the share and seed
helpers, weight transfer by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("monarch.actor")

from composer_replication.recipes.monarch.actors import (
    is_split_environment,
    load_trainable_state,
    shard_seed,
    trainable_state,
)


def test_teacher_pool_replays_states_through_local_teachers_in_its_process():
    from monarch.actor import this_host

    from composer_replication.recipes.monarch.actors import TeacherPoolActor
    from composer_replication.testing.openai_server import LocalOpenAIServer

    states = [
        {
            "state_id": f"s{i}",
            "messages": [{"role": "user", "content": f"task s{i}"}],
            "student_action": "student answer",
        }
        for i in range(3)
    ]
    with LocalOpenAIServer() as server:
        teachers = [
            {
                "slug": f"local/t{j}",
                "input_per_mtok": 1.0,
                "output_per_mtok": 2.0,
                "base_url": server.base_url,
            }
            for j in range(2)
        ]
        procs = this_host().spawn_procs(per_host={"procs": 1}, name="teachers")
        try:
            pool = procs.spawn("teacher_pool", TeacherPoolActor)
            rows = pool.replay.call_one(states, teachers, max_total_usd=1.0, max_tokens=32).get(
                timeout=120
            )
        finally:
            procs.stop().get(timeout=30)
        assert server.request_count == 6
    by_key = {(r["state_id"], r["teacher_slug"]): r for r in rows}
    assert len(by_key) == 6
    for (state_id, slug), row in by_key.items():
        assert row["error"] is None
        assert row["response_text"] == f"[{slug}] task {state_id}"
        assert row["cost_usd"] > 0


def test_shard_seeds_differ_per_step_environment_and_share_and_repeat():
    seeds = {shard_seed(0, step, env, k) for step in range(3) for env in range(2) for k in range(2)}
    assert len(seeds) == 12
    assert shard_seed(7, 1, 0, 1) == shard_seed(7, 1, 0, 1)
    assert all(0 <= s < 2**63 for s in seeds)


def test_trainable_state_moves_only_trainable_parameters_by_name():
    src, dst = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    src.bias.requires_grad_(False)
    state = trainable_state(src)
    assert set(state) == {"weight"}
    load_trainable_state(dst, state)
    assert torch.equal(dst.weight, src.weight) and not torch.equal(dst.bias, src.bias)
    with pytest.raises(ValueError, match="unknown parameters"):
        load_trainable_state(dst, {"lora_A": torch.zeros(1)})


def test_single_turn_environments_split_and_multi_turn_ones_do_not():
    from composer_replication.envs.feature_deletion import FeatureDeletionEnv
    from composer_replication.envs.python_functions import PythonFunctionsEnv

    assert is_split_environment(PythonFunctionsEnv())
    assert not is_split_environment(FeatureDeletionEnv)  # episodes run on the generators
