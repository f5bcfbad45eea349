"""Data parallelism on 2 gloo ranks (real processes, real FSDP2) against one process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("dp_worker.py")
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(rank: int, world: int, port: int, mode: str, out: Path, die_at: int = -1):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(WORKER), str(rank), str(world), str(port), mode, str(out)]
    return subprocess.Popen(
        [*args, str(die_at)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(procs, bound_s: float = 300):
    """Wait for every process (bounded: a hang fails the test instead of the suite)."""
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=bound_s)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("a rank hung")
        results.append((proc.returncode, err))
    return results


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_two_ranks_equal_one_process_after_two_steps(tmp_path, mode):
    """The composer recipe's components (rl, jsd, dpo), ranks with different numbers of
    micro-batches and forwards: the same parameters as one process on the whole batch."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    port = _free_port()
    procs = [_start(0, 1, 0, mode, one)] + [_start(r, 2, port, mode, two) for r in (0, 1)]
    for code, err in _finish(procs):
        assert code == 0, err[-3000:]
    reference = torch.load(f"{one}.rank0")
    sys.path.insert(0, str(WORKER.parent))
    from dp_worker import build_policy

    initial = dict(build_policy(mode == "lora").named_parameters())
    moved = 0
    for rank in (0, 1):
        sharded = torch.load(f"{two}.rank{rank}")
        assert set(sharded) <= set(reference)
        for name, value in sharded.items():
            assert torch.allclose(value, reference[name], atol=1e-6, rtol=0), name
            if initial[name].requires_grad:
                moved += int((value - initial[name].detach()).abs().max() > 1e-4)
    assert moved > 0  # the steps changed the trainable weights (the check is not vacuous)
    shares = [json.loads(Path(f"{two}.rank{r}.tasks").read_text()) for r in (0, 1)]
    everything = json.loads(Path(f"{one}.rank0.tasks").read_text())
    assert shares[0] and shares[1]
    assert not {tuple(s) for s in shares[0]} & {tuple(s) for s in shares[1]}
    assert sorted(shares[0] + shares[1]) == sorted(everything)


def test_a_killed_rank_makes_the_other_fail_with_a_clear_error(tmp_path):
    port = _free_port()
    procs = [
        _start(0, 2, port, "full", tmp_path / "x.pt"),
        _start(1, 2, port, "full", tmp_path / "x.pt", die_at=1),
    ]
    (code0, err0), (code1, _) = _finish(procs, bound_s=240)
    assert code1 == -signal.SIGKILL
    assert code0 != 0
    assert "rank 0 of 2:" in err0
    assert "with the other ranks failed; a rank died" in err0


def train_on_two_ranks(toml: Path) -> tuple[list[str], dict]:
    """Run ``composer-replication train TOML --nproc 2`` (it must succeed); its command line
    and environment."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "composer_replication", "train", str(toml), "--nproc", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return cmd, env


def _resume_step_2(cmd: list[str], env: dict, run: Path, into: Path) -> list[dict]:
    """A copy of ``run`` without its step-2 checkpoint, resumed by ``cmd --resume``: the
    metrics rows it ends with."""
    shutil.copytree(run, into, ignore=shutil.ignore_patterns("step_000002"))
    again = subprocess.run(
        [*cmd, "--resume", "--output-dir", str(into)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-5000:]
    return [json.loads(line) for line in (into / "metrics.jsonl").read_text().splitlines()]


def _steady(rows: list[dict]) -> list[dict]:
    """Metrics rows without their timings (the only values two equal runs may differ in)."""
    volatile = ("time/", "memory/", "tokens_per_s/")  # timings, the process's peak memory
    return [{k: v for k, v in row.items() if not k.startswith(volatile)} for row in rows]


def _run_config(tmp_path: Path, tiny_dir: str) -> Path:
    # float32 in one process too (several CPU ranks are float32): the runs compare exactly
    model = (
        f'[model]\nsource = "{tiny_dir}"\ndevice = "cpu"\ndtype = "float32"\n'
        "[model.lora]\nr = 4\nalpha = 8"
    )
    toml = tmp_path / "run.toml"
    toml.write_text(f"""
seed = 0
steps = 2
output_dir = "{tmp_path / "run"}"
{model}
[optim]
lr = 1e-2
[eval]
every = 2
max_tasks = 4
samples_per_task = 1
temperature = 0
[guard]
min_steps = 100
[checkpoint]
every = 1
[[envs]]
name = "recording_env:make_env"
tasks_per_step = 3
options = {{ record_dir = "{tmp_path}", n_tasks = 16, rising = false }}
[envs.algorithm.sampling]
group_size = 2
max_new_tokens = 6
[envs.algorithm.advantage]
type = "grpo"
""")
    return toml


def test_train_on_two_ranks_from_the_command_line(tmp_path):
    """`composer-replication train --nproc 2`: each rank samples its own share of every
    step's tasks, held-out tasks reach no rank's training, rank 0 writes the run."""
    from composer_replication.model.loading import save_checkpoint, tiny_policy

    model, tok = tiny_policy(seed=0)
    tiny_dir = str(save_checkpoint(model, tmp_path / "tiny", tokenizer=tok))
    toml = _run_config(tmp_path, tiny_dir)
    cmd, env = train_on_two_ranks(toml)
    calls = [
        [json.loads(line) for line in (tmp_path / f"calls.rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]
    train = [[ids for kind, ids in rank_calls if kind == "train"] for rank_calls in calls]
    assert len(train[0]) == len(train[1]) == 2  # one call per step on each rank
    for step in range(2):
        mine, theirs = set(train[0][step]), set(train[1][step])
        assert mine and theirs and not mine & theirs  # disjoint shares of the step's 3 tasks
        assert len(mine | theirs) == 3
    evals = [{t for kind, ids in rank_calls if kind == "eval" for t in ids} for rank_calls in calls]
    trained = {t for rank in train for ids in rank for t in ids}
    assert evals[0] and evals[1] and not evals[0] & evals[1]  # held-out split across ranks
    assert not trained & (evals[0] | evals[1])  # held-out tasks never reach training
    run = tmp_path / "run"
    summary = json.loads(next(run.rglob("summary.json")).read_text())
    assert summary["steps"] == 2
    final = Path(summary["final_model"])
    assert (final / "config.json").is_file() and list(final.glob("*.safetensors"))
    assert len(list(run.rglob("summary.json"))) == 1  # rank 0 alone wrote
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "rollouts/count" in row]
    assert [row["rollouts/count"] for row in steps] == [6.0, 6.0]  # 3 tasks x 2, both ranks
    # the ranks' sharded checkpoint of step 1, resumed on 2 ranks, replays step 2 exactly
    assert (run / "checkpoints" / "step_000001" / "sharded" / ".metadata").is_file()
    resumed = tmp_path / "resumed_run"
    replayed = _resume_step_2(cmd, env, run, resumed)
    assert _steady(replayed) == _steady(rows)

    def final_weights(run_dir: Path) -> dict:
        from safetensors.torch import load_file

        return load_file(str(next((run_dir / "final_model").glob("*.safetensors"))))

    want, got = final_weights(run), final_weights(resumed)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # ... and resumed in ONE process it replays step 2 as well: a group samples the same
    # completions on any rank (seeded by the step and its prompt), so only the summation
    # order of the ranks' gradients differs
    single = tmp_path / "single_run"
    replayed = _resume_step_2(cmd[:-2], env, run, single)  # without --nproc 2
    assert len(replayed) == len(rows)
    for mine, theirs in zip(_steady(replayed), _steady(rows)):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            if key.startswith("heldout/"):
                continue  # the scripted env scores an evaluation call by its tasks' positions
            if key in ("tokens/forward", "tokens/padding_fraction"):
                continue  # each rank computes the prefixes its own rows share
            if isinstance(value, float):
                assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key
            else:
                assert mine[key] == value, key
    # the checkpoint the two ranks wrote resumes in one process
    from composer_replication.config.run import RunConfig
    from composer_replication.training.loop import Trainer

    sys.path.insert(0, str(WORKER.parent))
    from recording_env import make_env

    config = RunConfig.from_toml(toml.read_text())
    environment = make_env(record_dir=str(tmp_path / "resumed"), n_tasks=16)
    (tmp_path / "resumed").mkdir()
    trainer = Trainer(config, environments={"recording_env:make_env": environment})
    assert trainer.resume() and trainer.step == 2
    trainable = [p for p in trainer.policy.parameters() if p.requires_grad]
    assert all(trainer.optimizer.state[p]["exp_avg"].abs().sum() > 0 for p in trainable)
