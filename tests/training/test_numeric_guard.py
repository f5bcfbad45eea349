"""A custom rl loss fails as user code: an exception is one line naming its import path and
how it is called; a NaN never reaches the weights, and stops the run (the component named)
unless guard.non_finite = "skip"."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from composer_replication.common.errors import UsageError
from composer_replication.config import RunConfig
from composer_replication.safety import CollapseStopError
from composer_replication.training.loop import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from scripted_env import ScriptedEnv

LOSSES = """
import torch

def nan_loss(logprobs, inference_logprobs, advantages, loss_mask, weights):
    return (logprobs * weights).sum() * float("nan")

def nan_at_step_one(logprobs, inference_logprobs, advantages, loss_mask, weights):
    global calls
    calls = globals().get("calls", 0) + 1
    value = -(advantages * logprobs * weights).sum()
    return value * float("nan") if calls == 1 else value

def two_args(logprobs, weights):
    return logprobs.sum()

def raises(logprobs, inference_logprobs, advantages, loss_mask, weights):
    raise KeyError("advantage_scale")
"""


@pytest.fixture
def losses(tmp_path, monkeypatch):
    (tmp_path / "user_losses.py").write_text(textwrap.dedent(LOSSES))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_losses", None)
    yield "user_losses"
    sys.modules.pop("user_losses", None)


def _trainer(tmp_path, tiny_dir, fn: str, *, steps: int = 1, mode: str = "stop") -> Trainer:
    config = RunConfig.from_toml(f'''
steps = {steps}
output_dir = "{tmp_path / "run"}"
[model]
source = "{tiny_dir}"
[model.lora]
r = 4
alpha = 8
[loss]
type = "custom"
import_path = "user_losses:{fn}"
[guard]
non_finite = "{mode}"
[eval]
at_start = false
max_tasks = 1
samples_per_task = 1
temperature = 0
greedy = false
[[envs]]
name = "scripted"
tasks_per_step = 2
[envs.algorithm.sampling]
group_size = 2
max_new_tokens = 6
[envs.algorithm.advantage]
type = "grpo"
''')
    return Trainer(config, environments={"scripted": ScriptedEnv(rising=False)})


def _trainable(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.policy.parameters() if p.requires_grad]


def test_a_nan_loss_stops_the_run_and_never_reaches_the_weights(tmp_path, tiny_dir, losses):
    trainer = _trainer(tmp_path, tiny_dir, "nan_loss")
    before = _trainable(trainer)
    with pytest.raises(CollapseStopError) as stop:
        trainer.run()
    reason = str(stop.value)
    assert reason.startswith("non-finite loss at step 1: ")
    assert "rl = nan" in reason and "loss.import_path = 'user_losses:nan_loss'" in reason
    for a, b in zip(before, _trainable(trainer)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the update was not applied


def test_skip_drops_the_bad_step_and_goes_on(tmp_path, tiny_dir, losses):
    trainer = _trainer(tmp_path, tiny_dir, "nan_at_step_one", steps=2, mode="skip")
    before = _trainable(trainer)
    result = trainer.run()
    assert result.steps == 2 and result.stopped_by_guard is None
    first, second = (r for r in result.metrics if r.get("step") in (1, 2) and "loss" in r)
    assert first["guard/non_finite_skipped"] == 1.0 and "rl = nan" in first["guard/non_finite"]
    assert "guard/non_finite" not in second
    changed = any(not torch.equal(a, b) for a, b in zip(before, _trainable(trainer)))
    assert changed  # step 2 trained


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        ("two_args", "raised TypeError: two_args() takes 2 positional arguments but 5 were given"),
        ("raises", "raised KeyError: 'advantage_scale'"),
    ],
)
def test_a_failing_custom_loss_is_one_line_naming_it(tmp_path, tiny_dir, losses, fn, says):
    with pytest.raises(UsageError) as err:
        _trainer(tmp_path, tiny_dir, fn).run()
    message = str(err.value)
    assert message.startswith(f"loss.import_path = 'user_losses:{fn}' {says}")
    assert "(it is called as fn(logprobs, inference_logprobs, advantages" in message
    assert "\n" not in message
