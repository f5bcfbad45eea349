"""trl backend: the run config mapped onto trl, the sandbox reward, the train split, and
one end-to-end ``train_with_trl`` run on the tiny model."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from composer_replication.backends.trl.run import (
    PythonFunctionsReward,
    _composer_settings,
    grpo_config_from_run,
    train_prompt_dataset,
    train_with_trl,
)
from composer_replication.backends.trl.trainer import default_hint
from composer_replication.config import RunConfig
from composer_replication.envs.python_functions import PythonFunctionsEnv
from composer_replication.safety import HeldoutSplit


@pytest.fixture(scope="module")
def env():
    return PythonFunctionsEnv(grading_workers=2)


def _config(text: str = "") -> RunConfig:
    return _from_text(
        f"""
seed = 7
steps = 3
[optim]
lr = 3e-4
betas = [0.8, 0.95]
grad_clip = 0.5
warmup_steps = 2
schedule = "cosine"
[[envs]]
name = "python_functions"
tasks_per_step = 3
[envs.algorithm.sampling]
group_size = 2
max_new_tokens = 24
temperature = 0.7
[envs.algorithm.advantage]
{text or 'type = "composer"'}
"""
    )


def _from_text(text: str) -> RunConfig:
    # RunConfig.from_toml stats its argument as a path first; keep long TOML text short of
    # the file-name limit by going through a file
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "run.toml"
    path.write_text(text)
    return RunConfig.from_toml(path)


def test_run_config_maps_onto_a_dr_grpo_config(tmp_path):
    args = grpo_config_from_run(_config(), tmp_path)
    assert (args.loss_type, args.scale_rewards, args.num_iterations) == ("dr_grpo", "none", 1)
    assert args.per_device_train_batch_size == 6 and args.num_generations == 2
    assert args.max_completion_length == 24 and args.temperature == 0.7
    assert (args.learning_rate, args.adam_beta1, args.adam_beta2) == (3e-4, 0.8, 0.95)
    assert args.max_grad_norm == 0.5 and args.warmup_steps == 2
    assert args.lr_scheduler_type == "cosine" and args.max_steps == 3 and args.seed == 7
    assert args.bf16 is False and args.beta == 0.0


def test_algorithm_settings_map_to_trainer_kwargs():
    composer = _composer_settings(_config())
    assert composer["alpha_sdpo"] == 0.1 and composer["beta_replay"] == 0.05
    assert composer["replay_dpo_beta"] == 0.1 and composer["sdpo_jsd_beta"] == 0.5
    assert composer["dpo_variant"] == "dpo" and composer["sdpo_wrapper"] == "none"
    assert composer["hint_fn"] is default_hint
    sdpo = _composer_settings(_config('type = "sdpo"\nhint_source = "none"'))
    assert sdpo["alpha_sdpo"] == 1.0 and sdpo["beta_replay"] == 0.0 and sdpo["hint_fn"] is None
    grpo = _composer_settings(_config('type = "grpo"'))
    assert (grpo["alpha_sdpo"], grpo["beta_replay"]) == (0.0, 0.0) and "hint_fn" not in grpo
    assert grpo["sdpo_jsd_beta"] == 0.5 and grpo["dpo_variant"] == "dpo"  # the run's [loss]
    with pytest.raises(ValueError, match="not 'max_rl'; use --backend native"):
        _composer_settings(_config('type = "max_rl"'))
    with pytest.raises(ValueError, match="teacher='ema'"):
        _composer_settings(_config('type = "sdpo"\nteacher = "ema"'))
    # loss settings come from the run's [loss] table, under the same names
    tuned = _config('type = "composer"\nsdpo_jsd_beta = 0.3')
    tuned = tuned.model_copy(
        update={"loss": tuned.loss.model_copy(update={"sdpo_wrapper": "taid"})}
    )
    kwargs = _composer_settings(tuned)
    assert kwargs["sdpo_jsd_beta"] == 0.3 and kwargs["taid_t"].t == pytest.approx(0.4)


def test_prompt_dataset_holds_train_tasks_only(env):
    split = HeldoutSplit(0.25)
    dataset = train_prompt_dataset(env, split)
    ids = dataset["task_id"]
    assert set(ids) == set(split.train_ids(env.task_ids())) and ids
    assert not any(split.is_heldout(t) for t in ids)
    assert dataset[0]["prompt"] == env.messages(env.tasks[ids[0]])


def test_reward_grades_in_the_sandbox_and_reports_feedback(env):
    task = next(iter(env.tasks.values()))
    reward = PythonFunctionsReward(env)
    solved = [{"role": "assistant", "content": f"```python\n{task.reference}\n```"}]
    wrong = [{"role": "assistant", "content": f"{task.prompt.rstrip()}\n    return None\n"}]
    values = reward(
        prompts=[None] * 3, completions=[solved, wrong, "no code"], task_id=[task.task_id] * 3
    )
    assert values == [1.0, 0.0, 0.0]
    assert reward.last_feedback[0] is None
    assert "FAILED test_" in reward.last_feedback[1]
    assert reward.last_feedback[2].startswith(f"No function named `{task.entry_point}`")
    assert reward.last_info[0] == {"passed": task.n_tests, "total": task.n_tests}
    with pytest.raises(ValueError, match="needs the dataset's task_id column"):
        reward(prompts=[None], completions=["x"])


def test_other_environments_are_rejected():
    cfg = RunConfig.from_toml('[[envs]]\nname = "feature_deletion"\n')
    with pytest.raises(ValueError, match="trains one python_functions environment"):
        train_with_trl(cfg)


@pytest.mark.slow
def test_train_with_trl_end_to_end(tmp_path):
    from composer_replication.model.loading import save_checkpoint, tiny_policy

    model, tokenizer = tiny_policy(seed=0)
    model_dir = save_checkpoint(model, tmp_path / "tiny", tokenizer=tokenizer)
    pairs = tmp_path / "pairs.jsonl"
    row = {
        "state_id": "s0",
        "state_messages": [{"role": "user", "content": "write f"}],
        "chosen": "def f():\n    return 1",
        "rejected": "def f():\n    pass",
    }
    pairs.write_text(json.dumps(row) + "\n")
    cfg = _from_text(
        f"""
steps = 1
output_dir = "{tmp_path / "run"}"
[model]
source = "{model_dir}"
[eval]
at_start = false
every = 1
max_tasks = 1
samples_per_task = 1
temperature = 0
[[envs]]
name = "python_functions"
tasks_per_step = 1
[envs.algorithm.sampling]
group_size = 2
max_new_tokens = 8
[envs.algorithm.advantage]
type = "composer"
pairs_path = "{pairs}"
"""
    )
    result = train_with_trl(cfg)
    assert result.steps == 1 and result.heldout_after == 0.0
    assert (result.final_model_dir / "config.json").is_file()
    (step_row,) = [r for r in result.metrics if r["step"] == 1]
    assert step_row["heldout/pass@1"] == 0.0 and step_row["guard/fired"] is False
    # the kill switch's KL reading, measured on the step's rollouts as the native loop does
    assert math.isfinite(step_row["kl/to_init"]) and step_row["kl/to_init"] >= 0.0
    assert step_row["loss/dpo"] == pytest.approx(0.6931472, abs=1e-6)
    assert step_row["sdpo/error_sites"] == 1.0  # no function in random text: all format errors
    # the report reads a trl run as it reads a native one: its loss plot has the channels
    from composer_replication.training.report import PANELS, plotted_series

    losses = next(keys for name, _, keys in PANELS if name == "losses.png")
    assert {"loss/jsd", "loss/dpo"} <= set(plotted_series(result.metrics, losses))
    assert "loss/rl" in step_row  # trl's GRPO loss, zero here: every reward is 0
    assert (tmp_path / "run" / "report" / "losses.png").is_file()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["backend"] == "trl" and summary["steps"] == 1
    assert summary["stopped_by_guard"] is None


def test_lifecycle_callback_evaluates_on_schedule_and_stops_when_the_guard_fires(tmp_path):
    from types import SimpleNamespace

    from composer_replication.backends.trl.run import _LifecycleCallback
    from composer_replication.samples.rollouts import Rollout
    from composer_replication.training.lifecycle import HeldoutTasks, RunLifecycle

    class OneTaskEnv:
        def rollouts(self, policy, tokenizer, ids, *, group_size, sampling):
            self.calls = getattr(self, "calls", 0) + 1
            return [[Rollout("t", [1], [2], [0.0], reward=1.0)] for _ in ids]

    class FiringGuard:
        def update(self, step, reward, heldout, *, kl_to_init=None, entropy=None):
            self.seen = (step, reward, heldout, entropy)
            return SimpleNamespace(fire=step >= 4, reason="held-out collapse", proxy_real_gap=0.0)

    base = _config()
    cfg = base.model_copy(
        update={
            "steps": 10,
            "eval": base.eval.model_copy(update={"every": 2}),
            "output_dir": str(tmp_path / "run"),
        }
    )
    env = OneTaskEnv()
    life = RunLifecycle(cfg, backend="trl")
    life.guard = FiringGuard()
    callback = _LifecycleCallback(life, None, None, [HeldoutTasks(env, ["t"], 8)])
    for step in (1, 2, 3, 4):
        control = SimpleNamespace(should_training_stop=False)
        callback.on_log(SimpleNamespace(global_step=step), control, {"reward": 0.5, "entropy": 2.0})
    # two evaluations (steps 2 and 4), each a sampled and a greedy pass
    assert env.calls == 4 and life.guard.seen == (4, 0.5, 1.0, 2.0)
    assert control.should_training_stop is True and life.stopped.reason == "held-out collapse"
    rows = life.metrics.rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("heldout/pass@1") for r in rows] == [None, 1.0, None, 1.0]
    assert rows[1]["guard/fired"] is False and rows[3]["guard/fired"] is True
    callback.on_log(SimpleNamespace(global_step=4), control, {"train_runtime": 1.0})
    assert len(life.metrics.rows()) == 4  # the end-of-training summary is not a step row


def test_the_guard_gets_the_exact_kl_to_the_initial_policy_of_the_last_rollouts(tmp_path):
    """KL(policy || initial) over the vocabulary at each completion position of trl's last
    padded micro-batch (prompts left-padded, completions right-padded), token-mean, against
    the same sum written out by hand."""
    from types import SimpleNamespace

    from composer_replication.backends.trl.run import _LifecycleCallback
    from composer_replication.model.loading import tiny_model
    from composer_replication.training.lifecycle import RunLifecycle

    policy = tiny_model(seed=0)
    base = _config()
    cfg = base.model_copy(update={"output_dir": str(tmp_path / "run")})
    tokenizer = SimpleNamespace(pad_token_id=0)
    trainer = SimpleNamespace(last_sampled=None)
    callback = _LifecycleCallback(
        RunLifecycle(cfg, backend="trl"), policy, tokenizer, [], trainer=trainer
    )
    assert callback.kl_to_initial() is None  # nothing trained yet
    with torch.no_grad():  # the policy moves away from its frozen initial copy
        gen = torch.Generator().manual_seed(1)
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.02)
    prompts = [[0, 0, 11, 12], [21, 22, 23, 24]]
    prompt_mask = [[0, 0, 1, 1], [1, 1, 1, 1]]
    completions = [[31, 32, 33], [41, 0, 0]]
    completion_mask = [[1, 1, 1], [1, 0, 0]]
    trainer.last_sampled = tuple(
        torch.tensor(x) for x in (prompts, prompt_mask, completions, completion_mask)
    )
    got = callback.kl_to_initial()

    temperature = cfg.loss.log_temperature
    total, count = 0.0, 0
    for row in ([11, 12, 31, 32, 33], [21, 22, 23, 24, 41]):
        n_prompt = 2 if row[0] == 11 else 4
        ids = torch.tensor([row])
        with torch.no_grad():
            p = torch.log_softmax(policy(input_ids=ids).logits[0].double() / temperature, -1)
            q = torch.log_softmax(
                callback.initial(input_ids=ids).logits[0].double() / temperature, -1
            )
        for t in range(n_prompt - 1, len(row) - 1):  # positions predicting completion tokens
            total += float((p[t].exp() * (p[t] - q[t])).sum())
            count += 1
    assert count == 4 and got > 0
    assert got == pytest.approx(total / count, rel=1e-4)


def test_lifecycle_callback_ends_a_trl_run_whose_time_budget_is_spent(tmp_path):
    from types import SimpleNamespace

    from composer_replication.backends.trl.run import _LifecycleCallback
    from composer_replication.samples.rollouts import Rollout
    from composer_replication.training.lifecycle import HeldoutTasks, RunLifecycle

    class OneTaskEnv:
        def rollouts(self, policy, tokenizer, ids, *, group_size, sampling):
            return [[Rollout("t", [1], [2], [0.0], reward=1.0)] for _ in ids]

    base = _config()
    cfg = base.model_copy(
        update={
            "steps": 10,
            "max_wall_seconds": 0.001,
            "eval": base.eval.model_copy(update={"every": 5}),
            "output_dir": str(tmp_path / "run"),
        }
    )
    life = RunLifecycle(cfg, backend="trl")
    callback = _LifecycleCallback(life, None, None, [HeldoutTasks(OneTaskEnv(), ["t"], 8)])
    control = SimpleNamespace(should_training_stop=False)
    time.sleep(0.01)  # the 1 ms budget is spent by the end of step 1
    callback.on_log(SimpleNamespace(global_step=1), control, {"reward": 0.5})
    assert control.should_training_stop is True and life.out_of_time_step == 1
    # the last step is evaluated although eval.every is 5
    assert life.metrics.rows()[-1]["heldout/pass@1"] == 1.0


def test_lifecycle_callback_stops_a_trl_run_whose_completions_game_the_grader(tmp_path):
    """The hack tripwire holds under trl too: the reward function's flags become metrics."""
    from types import SimpleNamespace

    from composer_replication.backends.trl.run import PythonFunctionsReward, _LifecycleCallback
    from composer_replication.envs.python_functions import PythonFunctionsEnv
    from composer_replication.training.lifecycle import RunLifecycle

    env = PythonFunctionsEnv()
    task = env.tasks["pf-001-sum-list"]
    # the real grader flags a candidate that tries to plant a file beside its answer
    sneaky = (
        f"```python\ndef {task.entry_point}(*a):\n"
        "    try:\n        open('planted.py', 'w').write('x')\n    except OSError as e:\n"
        "        print(e)\n    return 0\n```"
    )
    reward = PythonFunctionsReward(env, workers=1)
    base = _config()
    cfg = base.model_copy(
        update={
            "steps": 10,
            "eval": base.eval.model_copy(update={"every": 100}),
            "guard": base.guard.model_copy(update={"hack_fraction_stop": 0.25, "hack_patience": 2}),
            "output_dir": str(tmp_path / "run"),
        }
    )
    life = RunLifecycle(cfg, backend="trl")
    callback = _LifecycleCallback(life, None, None, [], reward=reward)
    for step in (1, 2):
        reward(prompts=[None, None], completions=[sneaky, sneaky], task_id=[task.task_id] * 2)
        control = SimpleNamespace(should_training_stop=False)
        callback.on_log(SimpleNamespace(global_step=step), control, {"reward": 0.0})
    rows = life.metrics.rows()
    assert [r["hack/flagged_fraction"] for r in rows] == [1.0, 1.0]
    assert [r["guard/hack_streak"] for r in rows] == [1, 2]
    assert control.should_training_stop is True
    assert "the policy games its grader" in life.stopped.reason
    assert reward.drain_tally() == {}  # drained by the callback


# a valid value other than the default, per [loss] setting
_NON_DEFAULT_LOSS = {
    "mask_low": 0.3,
    "mask_high": 0.3,
    "adv_tau": 0.5,
    "kl_tau": 0.01,
    "temperature": 1.0,
    "sdpo_jsd_beta": 0.9,
    "sdpo_temperature": 0.7,
    "sdpo_token_clip": 5.0,
    "sdpo_top_k": 20,
    "sdpo_wrapper": "entropy_opd",
    "taid_t": 0.5,
    "taid_t_start": 0.3,
    "taid_t_end": 0.9,
    "entropy_opd_h_max": 2.0,
    "replay_dpo_beta": 0.2,
    "dpo_variant": "simpo",
    "simpo_beta": 3.0,
    "simpo_gamma": 0.5,
    "lm_ce_label_smoothing": 0.1,
    "type": "custom",
    "import_path": "composer_replication.ops.token_losses:rl_loss",
    "kwargs": {"kl_tau": 0.01},
    "coefficients": {"rl": 2.0, "ce": 1.0, "ref_kl": 1.0, "jsd": 1.0, "dpo": 1.0},
    "kl_token_trust_threshold": 0.1,
    "chunk_size": 64,
}


_CUSTOM_LOSS = ("type", "import_path", "kwargs")


@pytest.mark.parametrize("name", sorted(_NON_DEFAULT_LOSS))
def test_every_loss_setting_is_applied_or_refused_by_each_backend(name):
    """The trl backend applies its own set of [loss] settings and refuses any other at
    start, in one line naming it (the native step takes the whole LossConfig)."""
    from composer_replication.backends.trl.run import TRL_APPLIED_LOSS_SETTINGS, _check_run
    from composer_replication.config.loss import LossConfig
    from composer_replication.config.run import RunConfig

    assert set(_NON_DEFAULT_LOSS) == set(LossConfig.model_fields)  # no setting left untested
    value = _NON_DEFAULT_LOSS[name]
    companions = [  # a custom rl loss is type, import_path and kwargs together
        f"loss.{other}={json.dumps(_NON_DEFAULT_LOSS[other])}"
        for other in _CUSTOM_LOSS
        if name in _CUSTOM_LOSS and other != name and other != "kwargs"
    ]
    config = RunConfig.default(
        [
            f"loss.{name}={json.dumps(value)}",
            *companions,
            "envs.0.algorithm.sampling.temperature=1.0",
        ]
    )
    assert getattr(config.loss, name) == value
    if name in TRL_APPLIED_LOSS_SETTINGS:
        _check_run(config)
    else:
        named = "type" if name in _CUSTOM_LOSS else name  # refused by its first field
        with pytest.raises(ValueError, match=rf"^loss\.{named}=.*does not apply") as err:
            _check_run(config)
        assert "\n" not in str(err.value)
