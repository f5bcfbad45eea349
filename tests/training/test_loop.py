"""The training loop end to end on the tiny model: every algorithm, the kill switch,
held-out discipline, resume after SIGKILL, a failing sandbox, the final model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from composer_replication.config import RunConfig
from composer_replication.safety import CollapseStopError, HeldoutLeakError
from composer_replication.training.loop import Trainer, train

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from scripted_env import ScriptedEnv  # noqa: E402

# timings, the process's peak memory, and the positions the forwards computed (they depend
# on how the work was laid out: which process had a pair's reference log-probs cached, which
# rows shared a forward)
VOLATILE = ("time/", "memory/", "tokens_per_s/", "tokens/forward", "tokens/padding_fraction")


def _config(
    tmp_path, tiny_dir, *, algo="grpo", env="scripted", steps=2, extra="", adv="", sampling=""
):
    return RunConfig.from_toml(f'''
seed = 0
steps = {steps}
output_dir = "{tmp_path / "run"}"
{extra}
[model]
source = "{tiny_dir}"
[model.lora]
r = 4
alpha = 8
[optim]
lr = 1e-2
[eval]
every = 1
max_tasks = 2
samples_per_task = 1
temperature = 0
[guard]
min_steps = 100
[checkpoint]
every = 1
[[envs]]
name = "{env}"
tasks_per_step = 2
[envs.algorithm.sampling]
group_size = 2
max_new_tokens = 8
{sampling}
[envs.algorithm.advantage]
type = "{algo}"
{adv}
''')


ALGORITHMS = {
    "grpo": "",
    "max_rl": "",
    "reward": "",
    "sdpo": "",
    "echo": "",
    "custom": 'import_path = "scripted_custom:per_token_advantages"',
    "replay_dpo": "",
    "composer": "",
}


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_every_algorithm_runs_two_steps(tmp_path, tiny_dir, pairs_file, algo):
    (tmp_path / "scripted_custom.py").write_text(
        "def per_token_advantages(group, **kw):\n"
        "    return [[r.reward - 0.5] * len(r.completion_ids) for r in group]\n"
    )
    sys.path.insert(0, str(tmp_path))
    adv = ALGORITHMS[algo]
    if algo in ("replay_dpo", "composer"):
        adv += f'\npairs_path = "{pairs_file}"'
    cfg = _config(tmp_path, tiny_dir, algo=algo, adv=adv)
    result = train(cfg, environments={"scripted": ScriptedEnv()})
    assert result.steps == 2
    rows = [r for r in result.metrics if r["step"] > 0]
    assert len(rows) == 2 and all("loss" in r for r in rows)
    if algo in ("replay_dpo", "composer"):
        assert rows[0]["tokens/dpo"] > 0
    if algo not in ("replay_dpo",):
        assert rows[0]["tokens/rl"] > 0
    assert (result.final_model_dir / "config.json").exists()
    assert (result.run_dir / "report" / "rewards.png").exists()


def test_sdpo_over_the_teachers_top_k_with_a_tail_bucket_trains_through_the_loop(
    tmp_path, tiny_dir
):
    """[loss] sdpo_top_k reaches the jsd component of the real loop: the same first step's
    rollouts give another jsd value than the full vocabulary, finite and positive."""
    rows = {}
    for name, extra in (("full", ""), ("top_k", "[loss]\nsdpo_top_k = 20")):
        cfg = _config(tmp_path / name, tiny_dir, algo="sdpo", steps=1, extra=extra)
        result = train(cfg, environments={"scripted": ScriptedEnv()})
        (rows[name],) = [r for r in result.metrics if r["step"] == 1]
    assert rows["top_k"]["tokens/jsd"] == rows["full"]["tokens/jsd"] > 0
    assert 0 < rows["top_k"]["loss/jsd"] < float("inf")
    assert rows["top_k"]["loss/jsd"] != pytest.approx(rows["full"]["loss/jsd"])


@pytest.mark.parametrize("algo", ["opd", "opsd", "sft"])
def test_reference_algorithms_run_with_a_local_frozen_model(tmp_path, tiny_dir, algo):
    model_ref = f'name = "frozen"\nlocal_path = "{tiny_dir}"'
    if algo == "sft":
        source = f'source = {{ name = "frozen", local_path = "{tiny_dir}" }}'
        cfg = _config(tmp_path, tiny_dir, algo=algo, sampling=source)
    else:
        extra_adv = f"[envs.algorithm.advantage.model]\n{model_ref}" if algo == "opd" else ""
        cfg = _config(tmp_path, tiny_dir, algo=algo, adv=extra_adv)
    result = train(cfg, environments={"scripted": ScriptedEnv()})
    assert result.steps == 2


def test_guard_stops_a_hacking_run_with_reason(tmp_path, tiny_dir):
    cfg = _config(tmp_path, tiny_dir, steps=12)
    data = cfg.model_dump()
    data["guard"].update(min_steps=2, decline_patience=2, ema_alpha=0.0, max_proxy_real_gap=10.0)
    data["eval"]["max_tasks"] = 8  # fine enough pass@1 steps to see the decline
    cfg = RunConfig.model_validate(data)
    with pytest.raises(CollapseStopError) as info:
        train(cfg, environments={"scripted": ScriptedEnv(rising=True)})
    assert "held-out" in str(info.value).lower() or "decline" in str(info.value).lower()
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    fired = [r for r in rows if r.get("guard/fired")]
    assert fired and fired[0]["guard/reason"] == str(info.value)
    assert (tmp_path / "run" / "checkpoints" / f"step_{fired[0]['step']:06d}").exists()
    assert fired[0]["step"] < 12


def test_a_spent_time_budget_makes_the_step_the_last_one(tmp_path, tiny_dir):
    # 1 ms: spent by the time step 1 ends, so step 1 is the run's last of 5
    cfg = _config(tmp_path, tiny_dir, steps=5, extra="max_wall_seconds = 0.001")
    cfg = cfg.model_copy(
        update={
            "eval": cfg.eval.model_copy(update={"every": 3}),
            "checkpoint": cfg.checkpoint.model_copy(update={"every": 3}),
        }
    )
    result = train(cfg, environments={"scripted": ScriptedEnv()})
    run = tmp_path / "run"
    assert result.steps == 1 and result.heldout_after is not None
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and "heldout/pass@1" in rows[1]
    assert (run / "checkpoints" / "step_000001").exists()  # the last step is saved
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["stopped_by_time_budget"] is True
    assert (run / "final_model" / "config.json").exists()


def test_a_time_budget_that_is_not_spent_changes_nothing(tmp_path, tiny_dir):
    cfg = _config(tmp_path, tiny_dir, steps=2, extra="max_wall_seconds = 3600")
    result = train(cfg, environments={"scripted": ScriptedEnv()})
    assert result.steps == 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by_time_budget"] is False


def test_cli_exit_code_when_the_guard_fires(tmp_path, tiny_dir):
    toml = tmp_path / "run.toml"
    cfg = _config(tmp_path, tiny_dir, env="scripted_env:make_env", steps=10)
    data = cfg.model_dump(mode="json")
    data["guard"].update(min_steps=2, decline_patience=2, ema_alpha=0.0, max_proxy_real_gap=10.0)
    data["eval"]["max_tasks"] = 8
    toml.write_text(_to_toml(data))
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    proc = subprocess.run(
        [sys.executable, "-m", "composer_replication.cli", "train", str(toml)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "kill switch" in proc.stdout


def test_heldout_tasks_never_reach_training(tmp_path, tiny_dir):
    env = ScriptedEnv(n_tasks=16)
    cfg = _config(tmp_path, tiny_dir, steps=3)
    trainer = Trainer(cfg, environments={"scripted": env})
    rt = trainer.runtimes[0]
    trainer.run()
    train_requested = {t for kind, ids in env.calls if kind == "train" for t in ids}
    eval_requested = {t for kind, ids in env.calls if kind == "eval" for t in ids}
    assert train_requested and train_requested <= set(rt.train_ids)
    assert not train_requested & set(rt.heldout_ids)
    assert eval_requested <= set(rt.heldout_ids)
    with pytest.raises(HeldoutLeakError):
        rt.curriculum.add_tasks([rt.heldout_ids[0]])
    with pytest.raises(HeldoutLeakError):
        trainer.split.check_trainable(rt.heldout_ids[:1])


def test_failing_sandbox_does_not_crash_the_loop(tmp_path, tiny_dir):
    from composer_replication.envs.python_functions import PythonFunctionsEnv

    def broken_sandbox(workdir):
        raise OSError("sandbox backend is down")

    class GradesTheReference(PythonFunctionsEnv):
        # the tiny model writes no function, so grade the reference: that reaches the sandbox
        def grade(self, task, completion_text):
            return super().grade(task, "```python\n" + task.reference + "\n```")

    env = GradesTheReference(sandbox_factory=broken_sandbox)
    reward, _, error, info = env.grade(env.tasks[env.task_ids()[0]], "")
    assert reward == 0.0 and error.startswith("sandbox: OSError")
    assert info["infrastructure_error"] is True  # the backend, not the policy, failed
    cfg = _config(tmp_path, tiny_dir, env="python_functions", steps=1)
    result = train(cfg, environments={"python_functions": env})
    row = result.metrics[-1]
    assert result.steps == 1 and row["reward/mean"] == 0.0
    assert row["rollouts/errors"] == row["rollouts/count"] == 4
    # left out of training: no rollout reaches the loss
    assert row["rollouts/infrastructure_errors"] == 4 and row["tokens/rl"] == 0


def test_training_twice_into_one_directory_keeps_the_runs_apart(tmp_path, tiny_dir):
    from composer_replication.training.run_record import PREVIOUS_DIR

    cfg = _config(tmp_path, tiny_dir, steps=1)
    first = train(cfg, environments={"scripted": ScriptedEnv()})
    second = train(cfg, environments={"scripted": ScriptedEnv()})
    rows = [json.loads(x) for x in (second.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # the second run's rows alone
    assert [r["step"] for r in rows] == [r["step"] for r in first.metrics]
    (previous,) = (second.run_dir / PREVIOUS_DIR).iterdir()
    old_rows = (previous / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in old_rows] == [0, 1]
    assert (previous / "final_model" / "config.json").is_file()
    assert (previous / "checkpoints" / "step_000001").is_dir()
    assert (second.run_dir / "final_model" / "config.json").is_file()


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.parametrize("algo", ["grpo", "composer"])
def test_resume_after_sigkill_reproduces_metrics_and_weights(tmp_path, tiny_dir, pairs_file, algo):
    steps = 4
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    adv = f'pairs_path = "{pairs_file}"' if algo == "composer" else ""

    def config(run_dir):
        cfg = _config(
            run_dir, tiny_dir, env="scripted_env:make_env", steps=steps, algo=algo, adv=adv
        )
        # rising=False: rewards depend only on the samples (the env keeps no state to restore)
        cfg.envs[0].options["rising"] = False
        return cfg

    env_vars = {**os.environ, "PYTHONPATH": str(HERE)}
    reference = train(config(ref_dir))  # uninterrupted (in process, same code path)
    toml = tmp_path / "kill.toml"
    toml.write_text(_to_toml(config(kill_dir).model_dump(mode="json")))
    cmd = [sys.executable, "-m", "composer_replication.cli", "train", str(toml)]
    proc = subprocess.Popen(cmd, env=env_vars, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = kill_dir / "run" / "checkpoints" / "step_000002"
    deadline = time.time() + 300
    while not target.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert target.exists(), "the run never reached its second checkpoint"
    resumed = subprocess.run(
        [*cmd, "--resume"], env=env_vars, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [
        json.loads(line) for line in (kill_dir / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert _strip(rows) == _strip(reference.metrics)
    if algo == "composer":
        assert all(r["tokens/dpo"] > 0 for r in rows if r["step"] > 0)
    from safetensors.torch import load_file

    def weights(run_dir):
        return load_file(str(next((run_dir / "run" / "final_model").glob("*.safetensors"))))

    ref_w, got_w = weights(ref_dir), weights(kill_dir)
    assert ref_w.keys() == got_w.keys()
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)  # bit for bit


def _to_toml(data) -> str:
    from composer_replication.config.toml_writer import dumps

    def prune(obj):
        if isinstance(obj, dict):
            return {k: prune(v) for k, v in obj.items() if v is not None}
        if isinstance(obj, list):
            return [prune(v) for v in obj]
        return obj

    return dumps(prune(data))


@pytest.mark.integration
def test_two_diloco_replicas_train_through_an_object_store(tmp_path, tiny_dir):
    """Two `train` processes meet through a file:// store: after each outer step their
    trainable weights are identical (sync_every=1, so the final models match)."""
    from safetensors.torch import load_file

    store = tmp_path / "rendezvous"
    cfg = _config(tmp_path, tiny_dir, env="scripted_env:make_env", steps=2)
    data = cfg.model_dump(mode="json")
    data["envs"][0]["options"]["rising"] = False
    data["eval"].update(at_start=False, every=100)
    data["diloco"].update(
        enabled=True,
        backend="object_store",
        sync_every=1,
        world_size=2,
        rendezvous=f"file://{store}",
        poll_interval_s=0.05,
        timeout_s=300,
    )
    procs = []
    for rank in (0, 1):
        run_dir = tmp_path / f"replica{rank}"
        data["output_dir"] = str(run_dir)
        toml = tmp_path / f"replica{rank}.toml"
        toml.write_text(_to_toml(data))
        env = {**os.environ, "PYTHONPATH": str(HERE), "REPLICA_RANK": str(rank)}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "composer_replication.cli", "train", str(toml)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    weights = [
        load_file(
            str(tmp_path / f"replica{r}" / "checkpoints" / "step_000002" / "trainable.safetensors")
        )
        for r in (0, 1)
    ]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
    rows = [
        json.loads(line)
        for line in (tmp_path / "replica0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r.get("diloco/synced") for r in rows if r["step"] > 0] == [1.0, 1.0]
    # the replicas saw different tasks (rank-offset task streams)
    assert (tmp_path / "replica0" / "metrics.jsonl").read_text() != (
        tmp_path / "replica1" / "metrics.jsonl"
    ).read_text()


def test_evaluation_sampling_is_seeded_and_leaves_training_rng_alone(tmp_path, tiny_dir):
    from composer_replication.evals.heldout import heldout_rollouts
    from composer_replication.inference.decoding.generate import InProcessSampler
    from composer_replication.model.loading import load_policy

    model, tok = load_policy(tiny_dir)
    policy = InProcessSampler(model)
    env = ScriptedEnv(n_tasks=4, max_new_tokens=6)
    kwargs = dict(samples_per_task=3, temperature=1.0, max_new_tokens=6)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = heldout_rollouts(env, policy, tok, env.ids, seed=5, **kwargs)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's stream is untouched
    again = heldout_rollouts(env, policy, tok, env.ids, seed=5, **kwargs)
    other = heldout_rollouts(env, policy, tok, env.ids, seed=6, **kwargs)

    def tokens(groups):
        return [r.completion_ids for g in groups for r in g]

    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)
    # a run's step and seed (the row-seed context training samples under) change nothing:
    # every evaluation of a run, and `eval` afterwards, draws the same numbers
    from composer_replication.inference.decoding.generate import derived_seed, seeded_rows

    with seeded_rows(derived_seed(7, "rollouts", 3)):
        inside_a_run = heldout_rollouts(env, policy, tok, env.ids, seed=5, **kwargs)
    assert tokens(inside_a_run) == tokens(first)


def test_every_evaluation_of_a_run_uses_the_same_random_numbers(tmp_path, tiny_dir):
    cfg = _config(tmp_path, tiny_dir, steps=1)
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"temperature": 1.0})})
    trainer = Trainer(cfg, environments={"scripted": ScriptedEnv()})
    seen = []
    original = trainer.heldout_tasks[0].env.rollouts

    def recording(*args, **kwargs):
        groups = original(*args, **kwargs)
        seen.append([r.completion_ids for g in groups for r in g])
        return groups

    trainer.heldout_tasks[0].env.rollouts = recording
    trainer.evaluate()
    trainer.step = 5  # a later evaluation of the same weights
    trainer.evaluate()
    assert seen[0] == seen[2]  # the sampled pass (the greedy one follows each)
