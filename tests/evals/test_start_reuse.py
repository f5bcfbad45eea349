"""The start evaluation of an initial policy evaluated before is read back, not sampled again:
the key names everything the numbers depend on, a second run reports the same step-0 row
and rollouts, and anything unreadable is measured again."""

from __future__ import annotations

import json

import pytest
import torch

from composer_replication.config import RunConfig
from composer_replication.envs.python_functions import PythonFunctionsEnv
from composer_replication.evals.start_reuse import start_evaluation_key, weights_digest
from composer_replication.training.lifecycle import HeldoutTasks
from composer_replication.training.loop import Trainer


def _config(tmp_path, tiny_dir, name="run", **top):
    config = RunConfig.from_toml(f'''
seed = 0
steps = 1
output_dir = "{tmp_path / name}"
save_rollouts = "eval"
[model]
source = "{tiny_dir}"
[model.lora]
r = 4
alpha = 8
[eval]
max_tasks = 2
samples_per_task = 2
[guard]
min_steps = 100
[[envs]]
name = "python_functions"
tasks_per_step = 1
[envs.algorithm.sampling]
group_size = 2
max_new_tokens = 8
''')
    return config.model_copy(update=top)


def _lora_policy(config, seed):
    from composer_replication.training.setup import setup_policy

    torch.manual_seed(seed)
    return setup_policy(config.model)


def test_the_key_names_what_the_start_evaluation_reads(tmp_path, tiny_dir):
    env = PythonFunctionsEnv()
    ids = env.task_ids()[:2]
    tasks = [HeldoutTasks(env, ids, 8)]
    base = _config(tmp_path, tiny_dir)
    policy, tokenizer = _lora_policy(base, seed=0)
    key = start_evaluation_key(base, policy, tokenizer, tasks)
    assert key is not None
    # what only training reads, and adapters drawn from another seed (they start at zero)
    other_seed, _ = _lora_policy(base, seed=1)
    assert not torch.equal(
        next(p for n, p in policy.named_parameters() if "lora_A" in n),
        next(p for n, p in other_seed.named_parameters() if "lora_A" in n),
    )
    trained_differently = _config(tmp_path, tiny_dir, name="other", seed=3, steps=7)
    trained_differently.optim.lr = 1e-2
    assert start_evaluation_key(trained_differently, other_seed, tokenizer, tasks) == key
    # what the evaluation reads
    other_eval = _config(tmp_path, tiny_dir)
    other_eval.eval.seed = 1
    assert start_evaluation_key(other_eval, policy, tokenizer, tasks) != key
    assert start_evaluation_key(base, policy, tokenizer, [HeldoutTasks(env, ids, 9)]) != key
    assert start_evaluation_key(base, policy, tokenizer, [HeldoutTasks(env, ids[:1], 8)]) != key
    edited = PythonFunctionsEnv()
    first = edited.tasks[ids[0]]
    edited.tasks[ids[0]] = type(first)(**{**first.__dict__, "tests": first.tests + "\n# more"})
    assert start_evaluation_key(base, policy, tokenizer, [HeldoutTasks(edited, ids, 8)]) != key
    before = weights_digest(policy)
    with torch.no_grad():
        next(p for n, p in policy.named_parameters() if "lora_B" in n).add_(0.01)
    assert weights_digest(policy) != before
    assert start_evaluation_key(base, policy, tokenizer, tasks) != key

    # an environment that cannot digest its tasks, or grades in sandboxes a closure makes,
    # is never reused
    class Opaque:
        pass

    assert start_evaluation_key(base, policy, tokenizer, [HeldoutTasks(Opaque(), ids, 8)]) is None
    closure = PythonFunctionsEnv(sandbox_factory=lambda path: None)
    assert start_evaluation_key(base, policy, tokenizer, [HeldoutTasks(closure, ids, 8)]) is None


def _run(config):
    trainer = Trainer(config)
    calls = []  # the steps of the held-out evaluations' sampling calls
    env, heldout = trainer.heldout_tasks[0].env, set(trainer.heldout_tasks[0].task_ids)
    original = env.rollouts

    def counting(sampler, tokenizer, task_ids, **kwargs):
        if set(task_ids) <= heldout:
            calls.append(trainer.step)
        return original(sampler, tokenizer, task_ids, **kwargs)

    env.rollouts = counting
    trainer.run()
    return trainer, calls


@pytest.mark.integration
def test_a_second_run_from_the_same_weights_reads_its_start_evaluation_back(
    tmp_path, tiny_dir, own_kept_evaluations
):
    first, first_calls = _run(_config(tmp_path, tiny_dir, name="first"))
    assert first_calls.count(0) == 2  # sampled, then greedy
    (record,) = own_kept_evaluations.glob("*[0-9a-f].json")
    second, second_calls = _run(_config(tmp_path, tiny_dir, name="second", seed=1))
    assert second_calls.count(0) == 0  # nothing sampled for step 0
    summaries = [
        json.loads((tmp_path / n / "summary.json").read_text()) for n in ("first", "second")
    ]
    assert [s["start_evaluation"] for s in summaries] == ["measured", "reused"]

    def measured(trainer):
        row = trainer.life.metrics.rows()[0]
        return {k: v for k, v in row.items() if not k.startswith(("time/", "memory/"))}

    assert measured(second) == measured(first)
    assert "heldout/greedy_pass@1" in measured(first)
    rollouts = "rollouts/eval_step_0000.jsonl"
    assert (tmp_path / "second" / rollouts).read_text() == (
        tmp_path / "first" / rollouts
    ).read_text()

    # reuse off: measured again
    off = _config(tmp_path, tiny_dir, name="third")
    off.eval.reuse_start = False
    _, off_calls = _run(off)
    assert off_calls.count(0) == 2

    # an unreadable record is measured again and kept anew
    record.write_text("{not json")
    _, again_calls = _run(_config(tmp_path, tiny_dir, name="fourth"))
    assert again_calls.count(0) == 2
    assert json.loads(record.read_text())["pass@1"] == first.life.heldout_before
