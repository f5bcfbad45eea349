"""``[inference]``'s decode settings reach every place that samples the policy in process: the
trainer's thread, the rollout queue's thread that samples ahead, and the Monarch generator
processes. Each sampler carries the options it was built with (no thread or process state),
and counts the decode loop each of its calls ran: the run configured for the static loop
samples only with it, the run configured for the general loop never takes it."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from composer_replication.inference.decoding.generate import DecodeOptions
from composer_replication.inference.in_process import InProcessEngine
from composer_replication.training.loop import Trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
from scripted_env import ScriptedEnv
from test_loop import _config


class RecordingEnv(ScriptedEnv):
    """The scripted environment, noting the thread and the sampler of every training call."""

    def __init__(self) -> None:
        super().__init__(rising=False)
        self.samplers: list[tuple[str, object]] = []

    def rollouts(self, sampler, tokenizer, task_ids, *, group_size, sampling):
        if sampling.temperature > 0:  # a training batch (evaluation samples greedily)
            self.samplers.append((threading.current_thread().name, sampler))
        return super().rollouts(
            sampler, tokenizer, task_ids, group_size=group_size, sampling=sampling
        )


def _run(tmp_path, tiny_dir, inference: str) -> tuple[Trainer, RecordingEnv]:
    env = RecordingEnv()
    trainer = Trainer(
        _config(tmp_path, tiny_dir, steps=2, extra=f"[inference]\n{inference}"),
        environments={"scripted": env},
    )
    trainer.run()
    return trainer, env


@pytest.mark.parametrize("loop", ["static", "general"])
def test_the_trainer_thread_decodes_with_the_configured_loop(tmp_path, tiny_dir, loop):
    trainer, env = _run(
        tmp_path, tiny_dir, f'async_level = 0\ndecode_loop = "{loop}"\nsync_every = 3'
    )
    assert isinstance(trainer.engine, InProcessEngine)
    assert {thread for thread, _ in env.samplers} == {"MainThread"}
    live = trainer.engine.sampler
    assert {id(s) for _, s in env.samplers} == {id(live)}
    assert live.decode == DecodeOptions(loop=loop, sync_every=3)
    # two training batches and the evaluations (before step 1, after each step)
    assert dict(live.decode_loops) == {loop: 2 + 3}


@pytest.mark.parametrize("loop", ["static", "general"])
def test_a_batch_sampled_ahead_decodes_with_the_configured_loop(tmp_path, tiny_dir, loop):
    trainer, env = _run(
        tmp_path,
        tiny_dir,
        f'async_level = 1\nmax_off_policy_steps = 1\ndecode_loop = "{loop}"\nsync_every = 3',
    )
    assert len(env.samplers) == 3  # batches 1-2, and batch 3 sampled ahead of no step
    assert all(thread.startswith("rollouts") for thread, _ in env.samplers)
    (ahead,) = {id(s): s for _, s in env.samplers}.values()
    assert ahead.model is not trainer.policy  # the snapshot's copy of the weights
    assert ahead.decode == DecodeOptions(loop=loop, sync_every=3)
    assert dict(ahead.decode_loops) == {loop: 3}
    assert dict(trainer.engine.sampler.decode_loops) == {loop: 3}  # the evaluations


@pytest.mark.slow
def test_a_monarch_generator_decodes_with_the_configured_loop(tmp_path, tiny_dir):
    pytest.importorskip("monarch.actor")
    from composer_replication.recipes.monarch.engine import MonarchTrainer

    monarch = '[roles]\nplacement = "monarch"\ngenerators = 1\nrewarders = 1\ncall_timeout_s = 120'
    for loop in ("static", "general"):
        extra = f'{monarch}\n[inference]\ndecode_loop = "{loop}"\nsync_every = 3'
        config = _config(tmp_path / loop, tiny_dir, env="python_functions", extra=extra)
        trainer = MonarchTrainer(config)
        try:
            groups = trainer.run_rollouts(trainer.pick_tasks(1))[0]
            assert groups and all(r.completion_ids for g in groups for r in g)
            generator = trainer.mesh.generator(0)
            loops = trainer.mesh.get(generator.decode_loops.call_one(), "generator 0")
        finally:
            trainer.mesh.close()
        assert loops == {loop: 1}


@pytest.mark.parametrize("loop", ["static", "general"])
def test_agent_episodes_decode_with_the_loop_their_sampler_carries(loop):
    """Episodes run from a thread that set nothing (as a rollout queue's worker): every turn
    of every episode samples with the loop of the sampler they were given."""
    from composer_replication.inference.decoding.generate import InProcessSampler, SamplingSettings
    from composer_replication.model.loading import tiny_policy
    from composer_replication.rollout.agent import Episode, run_agent_rollouts, sampler_step

    model, tok = tiny_policy(seed=0)
    sampler = InProcessSampler(model, decode=DecodeOptions(loop=loop, sync_every=3))
    prompt = [{"role": "user", "content": "Say hello."}]
    done: list = []

    def episodes() -> None:
        done.extend(
            run_agent_rollouts(
                None,
                tok,
                [Episode(f"e{i}", list(prompt)) for i in range(3)],
                sampling=SamplingSettings(max_new_tokens=6),
                max_turns=2,
                tools={"finish": lambda state, arguments: "done"},
                sample_fn=sampler_step(sampler, tok),
            )
        )

    worker = threading.Thread(target=episodes)
    worker.start()
    worker.join()
    assert len(done) == 3
    turns = sum(r.metadata["turns"] for r in done)
    assert set(sampler.decode_loops) == {loop}
    assert 1 <= sampler.decode_loops[loop] <= turns  # one batched call per round of turns
