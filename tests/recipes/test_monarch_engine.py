"""The Monarch engine: the native loop's results with roles on Monarch processes."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

pytest.importorskip("monarch.actor")

from composer_replication.config import RunConfig
from composer_replication.recipes.monarch.engine import (
    ActorFailedError,
    MonarchTrainer,
    shares,
)
from composer_replication.training.loop import Trainer

# timings, the process's peak memory, and the positions the forwards computed (they depend
# on how the work was laid out: which process had a pair's reference log-probs cached, which
# rows shared a forward)
VOLATILE = ("time/", "memory/", "tokens_per_s/", "tokens/forward", "tokens/padding_fraction")


def _config(
    run_dir,
    model_source,
    *,
    steps=2,
    temperature=1.0,
    engine="",
    lora=True,
    algo="grpo",
    adv="",
    eval_every=1,
):
    lora_table = "[model.lora]\nr = 4\nalpha = 8\n" if lora else ""
    return RunConfig.from_toml(f'''
seed = 0
steps = {steps}
output_dir = "{run_dir}"
[model]
source = "{model_source}"
{lora_table}
[optim]
lr = 1e-2
[eval]
every = {eval_every}
max_tasks = 2
samples_per_task = 1
temperature = 0
[guard]
min_steps = 100
[checkpoint]
every = 1
{engine}
[[envs]]
name = "python_functions"
tasks_per_step = 3
[envs.algorithm.sampling]
group_size = 2
max_new_tokens = 8
temperature = {temperature}
[envs.algorithm.advantage]
type = "{algo}"
{adv}
''')


MONARCH = '[roles]\nplacement = "monarch"\ngenerators = 2\nrewarders = 1\ncall_timeout_s = 120'


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def test_shares_are_contiguous_and_balanced():
    assert shares([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert shares([1], 3) == [[1], [], []]
    assert shares([], 2) == [[], []]


@pytest.mark.slow
def test_two_near_greedy_steps_match_the_native_loop(tmp_path, tiny_dir, pairs_file):
    """At a temperature where sampling is argmax (1e-3), the same tasks, completions,
    rewards, losses and weights as the native loop. At ordinary temperatures the tokens
    differ: the native loop draws from one torch stream, each generator from its own stream
    seeded by (seed, step, environment, share) (next test). replay_dpo trains on trace
    pairs, so the weights move although near-greedy groups carry no group-relative signal."""
    algo = {"algo": "replay_dpo", "adv": f'pairs_path = "{pairs_file}"', "temperature": 1e-3}
    native = Trainer(_config(tmp_path / "native", tiny_dir, **algo))
    initial = [p.detach().clone() for p in native.policy.parameters()]
    native.run()
    mon = MonarchTrainer(_config(tmp_path / "monarch", tiny_dir, engine=MONARCH, **algo))
    mon.run()
    a, b = _metrics(tmp_path / "native"), _metrics(tmp_path / "monarch")
    assert len(a) == len(b) == 3  # the initial evaluation, two steps
    assert a[1]["grad_norm"] > 0 and a[1]["tokens/dpo"] > 0
    for row_a, row_b in zip(a, b):
        assert row_a.keys() == row_b.keys()
        for key in row_a:
            if isinstance(row_a[key], float):
                assert row_b[key] == pytest.approx(row_a[key], rel=1e-4, abs=1e-6), key
            else:
                assert row_b[key] == row_a[key], key
    # The controller's copy (final model, evaluation) holds the trainer's last weights.
    moved = 0
    for (name, p), q, p0 in zip(native.policy.named_parameters(), mon.policy.parameters(), initial):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)
        moved += not torch.equal(p, p0)
    assert moved > 0
    assert (tmp_path / "monarch" / "summary.json").exists()


@pytest.mark.slow
def test_a_resumed_monarch_run_continues_like_the_native_loop(tmp_path, tiny_dir, pairs_file):
    """One step, then --resume to two: both engines restore the checkpoint (the trainer
    process its weights, optimizer and schedule; the controller its curriculum, pairs and
    task stream) and their second steps match."""
    algo = {"algo": "replay_dpo", "adv": f'pairs_path = "{pairs_file}"', "temperature": 1e-3}
    for name, engine, cls in (("native", "", Trainer), ("monarch", MONARCH, MonarchTrainer)):
        cls(_config(tmp_path / name, tiny_dir, steps=1, engine=engine, **algo)).run()
        cls(_config(tmp_path / name, tiny_dir, steps=2, engine=engine, **algo)).run(resume=True)
    a, b = _metrics(tmp_path / "native"), _metrics(tmp_path / "monarch")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    for key, value in a[2].items():
        if isinstance(value, float):
            assert b[2][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.fixture(scope="module")
def monarch_run(tmp_path_factory, tiny_dir, pairs_file):
    """One Monarch controller with its processes (2 generators, 1 rewarder, 1 trainer),
    shared by the tests below; replay_dpo so that a step surely moves the weights."""
    run_dir = tmp_path_factory.mktemp("monarch") / "run"
    adv = f'pairs_path = "{pairs_file}"'
    mon = MonarchTrainer(_config(run_dir, tiny_dir, engine=MONARCH, algo="replay_dpo", adv=adv))
    try:
        mon.learner.sync_weights()
        yield mon
    finally:
        mon.mesh.close()


@pytest.mark.slow
def test_generators_sample_their_share_with_the_share_seed(monarch_run):
    """Each generator's rollouts are exactly in-process sampling of its contiguous share
    under torch.manual_seed(shard_seed(seed, step, env, share)), graded by the rewarder as
    in-process grading would, tagged with the version of the weights that sampled them."""
    from composer_replication.inference.decoding.generate import InProcessSampler
    from composer_replication.recipes.monarch.actors import shard_seed

    mon = monarch_run
    tasks = mon.pick_tasks(1)
    groups = mon.run_rollouts(tasks)[0]
    rt = mon.runtimes[0]
    local = []
    for k, share in enumerate(shares(tasks[0], 2)):
        torch.manual_seed(shard_seed(0, mon.step, 0, k))
        sampled = rt.env.sample(
            InProcessSampler(mon.policy), mon.tokenizer, share, group_size=2, sampling=rt.sampling
        )
        local += rt.env.grade_groups(sampled)
    assert [g[0].task_id for g in groups] == tasks[0]
    assert [[r.completion_ids for r in g] for g in groups] == [
        [r.completion_ids for r in g] for g in local
    ]
    assert [[r.reward for r in g] for g in groups] == [[r.reward for r in g] for g in local]
    assert [[r.metadata["passed"] for r in g] for g in groups] == [
        [r.metadata["passed"] for r in g] for g in local
    ]
    assert {r.metadata["policy_version"] for g in groups for r in g} == {mon.learner.version}


@pytest.mark.slow
def test_weights_reach_the_generators(monarch_run):
    """After a step, a generator's log-probs of a fixed completion equal the trainer's
    recomputation with the new weights; before the sync they were the old ones."""
    from composer_replication.samples.wire import pack_samples

    mon, mesh = monarch_run, monarch_run.mesh
    prompt, completion = [5, 6, 7, 8], [9, 10, 11]
    gen = mesh.generator(1)
    before = mesh.get(gen.completion_logprobs.call_one(prompt, completion), "generator 1")
    samples, _ = mon.collect()
    batches = pack_samples(samples, max_tokens=1024, pad_id=0, split=mon.split)
    version = mon.learner.version + 1
    mesh.get(mesh.trainer.call_learner.call_one("update", [batches, version]), "trainer")
    trainer_lp = mesh.get(mesh.trainer.completion_logprobs.call_one(prompt, completion), "trainer")
    stale = mesh.get(gen.completion_logprobs.call_one(prompt, completion), "generator 1")
    assert stale == before
    assert trainer_lp != pytest.approx(before, abs=1e-6)
    assert mon.learner.sync_weights() == version
    after = mesh.get(gen.completion_logprobs.call_one(prompt, completion), "generator 1")
    assert after == pytest.approx(trainer_lp, abs=1e-5)
    groups = mon.run_rollouts(mon.pick_tasks(1))[0]
    assert {r.metadata["policy_version"] for g in groups for r in g} == {version}


@pytest.mark.slow
def test_a_killed_generator_ends_the_run_with_its_name(tmp_path, tiny_dir):
    config = _config(tmp_path / "run", tiny_dir, steps=50, engine=MONARCH, eval_every=100)
    mon = MonarchTrainer(config)
    victim = mon.mesh.pids["generator 1"]
    original = mon.mesh.rollouts
    calls = []

    def rollouts_then_kill(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # mid-run: the second step asks for its rollouts
            os.kill(victim, signal.SIGKILL)  # before it: a timer could lose the race
        return original(*args, **kwargs)

    mon.mesh.rollouts = rollouts_then_kill
    with pytest.raises(ActorFailedError, match="generator 1") as failure:
        mon.run()
    assert failure.value.actor == "generator 1"
    assert mon.step == 1  # the first step finished; its checkpoint is there to resume
    assert (tmp_path / "run" / "checkpoints").exists()


def test_roles_config_is_validated():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="generators"):
        RunConfig.model_validate({"roles": {"placement": "monarch", "generators": 0}})
    with pytest.raises(ValidationError, match="roles"):
        RunConfig.model_validate({"roles": {"placement": "ray"}})
    assert RunConfig().roles.placement == "in_process"


def test_the_old_engine_table_still_loads_with_a_warning():
    from composer_replication.config import ConfigDeprecationWarning

    with pytest.warns(ConfigDeprecationWarning, match=r"'engine' is deprecated, write 'roles'"):
        old = RunConfig.from_toml('[engine]\ntype = "monarch"\ngenerators = 3\n')
    new = RunConfig.from_toml('[roles]\nplacement = "monarch"\ngenerators = 3\n')
    assert old == new and old.roles.generators == 3
    with pytest.warns(ConfigDeprecationWarning):
        assert RunConfig.default(["engine.type=monarch"]).roles.placement == "monarch"
    with pytest.raises(ValueError, match="contradicts"):
        RunConfig.model_validate(
            {"engine": {"type": "monarch"}, "roles": {"placement": "in_process"}}
        )


def test_sampling_ahead_is_refused_with_the_monarch_engine(tmp_path, tiny_dir):
    config = _config(tmp_path, tiny_dir, engine=MONARCH)
    config = config.model_copy(
        update={"inference": config.inference.model_copy(update={"async_level": 1})}
    )
    with pytest.raises(
        ValueError, match=r"async_level = 1 with the roles on monarch.*set async_level = 0"
    ):
        MonarchTrainer(config)
