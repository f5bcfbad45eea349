"""The seed API to the letter: TAIDScheduler.update_t / t, DEFAULT_TEACHERS, HeldOutGuard ranges.

Values are computed by hand in the comments; every assertion can fail.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math

import pytest
import torch

from composer_replication.config.loss import LossConfig
from composer_replication.config.run import GuardConfig
from composer_replication.distillation import TAIDScheduler
from composer_replication.safety import HeldOutGuard
from composer_replication.traces.cli import load_teachers
from composer_replication.traces.teacher_replay import DEFAULT_TEACHERS, replay_trace
from composer_replication.training.loss_schedule import LossSchedule

# --- TAIDScheduler --------------------------------------------------------------------------


@pytest.mark.parametrize("t_start", [0.1, 0.3, 0.7, 0.0, 1.0])
def test_t_is_the_exact_python_float(t_start: float) -> None:
    sched = TAIDScheduler(10, t_start=t_start)
    assert type(sched.t) is float
    assert sched.t == t_start  # exact: 0.1 is not read back as float32's 0.10000000149
    assert sched.state_dict()["t"] == t_start


def test_update_t_returns_delta_t_and_t_moves_by_the_hand_computed_step() -> None:
    sched = TAIDScheduler(10, t_start=0.1, t_end=1.0, alpha=0.5, beta=0.5)
    assert sched.update_t(2.0, 0) is None  # the first finite loss only seeds
    assert sched.t == 0.1
    delta = sched.update_t(1.0, 1)
    # relative change (2 - 1) / (2 + 1e-15) = 0.5; momentum 0.5*0 + 0.5*0.5 = 0.25;
    # delta_t = 0.5 * sigmoid(0.25) * (1 - 0.1) = 0.45 * 0.5621765008857981 = 0.252979425...;
    # floor 0.1 + 0.9 * 1/10 = 0.19 < 0.1 + delta_t, so t = 0.352979425...
    assert isinstance(delta, torch.Tensor) and delta.dim() == 0
    assert delta.dtype == torch.float32 and delta.device == torch.device("cpu")
    assert delta.item() == pytest.approx(0.25297942539860914, rel=1e-6)
    assert type(sched.t) is float
    assert sched.t == pytest.approx(0.35297942539860914, abs=1e-15)
    state = sched.state_dict()
    assert (state["t"], state["prev_loss"]) == (sched.t, 1.0)
    assert state["momentum"] == pytest.approx(0.25, abs=1e-15)  # 0.5 / (2 + 1e-15) * 0.5


def test_delta_t_is_the_proposed_step_not_the_change_of_t_when_the_floor_wins() -> None:
    sched = TAIDScheduler(4, t_start=0.2, t_end=1.0, alpha=1e-3, beta=0.9)
    sched.update_t(1.0, 0)
    delta = sched.update_t(1.0, 1)
    # no loss change -> momentum 0 -> delta_t = 1e-3 * 0.5 * (1 - 0.2) = 4e-4;
    # the floor 0.2 + 0.8 * 1/4 = 0.4 is higher, so t jumps to 0.4 (a change of 0.2).
    assert delta.item() == pytest.approx(4e-4, rel=1e-6)
    assert sched.t == 0.4


def test_delta_t_is_returned_with_adaptive_disabled_and_at_the_cap() -> None:
    linear = TAIDScheduler(8, t_start=0.3, t_end=0.9, alpha=1.0, disable_adaptive=True)
    linear.update_t(4.0, 0)
    delta = linear.update_t(2.0, 2)
    # momentum 0.01 * 0.5 = 0.005; delta_t = 1.0 * sigmoid(0.005) * 0.7, not applied:
    # t = the floor 0.3 + 0.6 * 2/8 = 0.45
    assert delta.item() == pytest.approx(0.7 / (1 + math.exp(-0.005)), rel=1e-6)
    assert linear.t == pytest.approx(0.45, abs=1e-15)

    capped = TAIDScheduler(100, t_start=0.85, t_end=0.9, alpha=1.0, beta=0.0)
    capped.update_t(1.0, 0)
    delta = capped.update_t(0.5, 1)
    # momentum = relative change 0.5; delta_t = sigmoid(0.5) * 0.15 = 0.0933...;
    # 0.85 + 0.0933 is above t_end, so t = 0.9 exactly
    assert delta.item() == pytest.approx(0.15 / (1 + math.exp(-0.5)), rel=1e-6)
    assert capped.t == 0.9


def test_returned_delta_lives_on_the_scheduler_device() -> None:
    sched = TAIDScheduler(10, device="meta")
    sched.update_t(1.0, 0)
    assert sched.update_t(0.5, 1).device.type == "meta"
    assert type(sched.t) is float  # the state is never on the device


def test_loss_schedule_caller_reads_t_as_a_float() -> None:
    config = LossConfig(sdpo_wrapper="taid", taid_t=None, taid_t_start=0.1, taid_t_end=1.0)
    schedule = LossSchedule(config, total_steps=10)
    assert schedule.current().taid_t == 0.1
    metrics = {"tokens/jsd": 5.0, "loss/jsd": 2.0}
    schedule.observe(metrics, 0)
    assert metrics["taid/t"] == 0.1
    schedule.observe({"tokens/jsd": 5.0, "loss/jsd": 1.0}, 1)
    # default alpha 5e-4, beta 0.99: momentum 0.005, delta_t ~ 2.25e-4 < the floor step 0.09
    assert schedule.current().taid_t == pytest.approx(0.19, abs=1e-15)
    restored = LossSchedule(config, total_steps=10)
    restored.load_state_dict(schedule.state_dict())
    assert restored.current().taid_t == schedule.current().taid_t


# --- DEFAULT_TEACHERS -------------------------------------------------------------------------

EXPECTED_TEACHERS = [
    {"slug": "anthropic/claude-opus-4.7", "input_per_mtok": 5.0, "output_per_mtok": 25.0},
    {"slug": "openai/gpt-5", "input_per_mtok": 1.25, "output_per_mtok": 10.0},
    {"slug": "deepseek/deepseek-v4-pro", "input_per_mtok": 1.74, "output_per_mtok": 3.48},
]


def test_default_teachers_is_the_documented_list() -> None:
    assert isinstance(DEFAULT_TEACHERS, list)
    assert DEFAULT_TEACHERS == EXPECTED_TEACHERS
    import composer_replication

    assert composer_replication.DEFAULT_TEACHERS is DEFAULT_TEACHERS
    default = inspect.signature(replay_trace).parameters["teachers"].default
    assert default is DEFAULT_TEACHERS


def test_callers_copy_default_teachers() -> None:
    before = copy.deepcopy(DEFAULT_TEACHERS)
    picked = load_teachers("openai/gpt-5,anthropic/claude-opus-4.7")
    assert [t["slug"] for t in picked] == ["openai/gpt-5", "anthropic/claude-opus-4.7"]
    picked[0]["input_per_mtok"] = 99.0
    picked.append({"slug": "x", "input_per_mtok": 0.0, "output_per_mtok": 0.0})
    assert before == DEFAULT_TEACHERS
    assert all(t is not d for t in picked for d in DEFAULT_TEACHERS)


def test_replay_with_the_default_teachers_leaves_them_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = copy.deepcopy(DEFAULT_TEACHERS)
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    state = {
        "state_id": "s::0000",
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
        "student_action": "ok",
    }
    with pytest.raises(RuntimeError, match="OPENROUTER_API_KEY"):
        asyncio.run(replay_trace([state]))
    assert before == DEFAULT_TEACHERS


# --- HeldOutGuard knob ranges -----------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"kl_hard_stop": 1e-12},
        {"max_proxy_real_gap": 0.0},
        {"max_proxy_real_gap": -0.5},
        {"max_proxy_real_gap": 1e9},
        {"min_steps": 0},
        {"min_steps": -5},
        {"decline_patience": 1},
        {"ema_alpha": 0.0},
        {"ema_alpha": 0.999999},
        {"rise_eps": 0.0},
        {"rise_eps": -1e-3},
    ],
)
def test_guard_accepts_the_spec_ranges(settings: dict) -> None:
    guard = HeldOutGuard(**settings)
    for name, value in settings.items():
        assert getattr(guard, name) == value
    # the config table accepts the same values and builds the same guard
    assert HeldOutGuard(**GuardConfig(**settings).guard_kwargs()) == guard


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("kl_hard_stop", 0.0, "> 0"),
        ("kl_hard_stop", -1e-9, "> 0"),
        ("kl_hard_stop", math.inf, "finite"),  # > 0, but it would switch the KL gate off
        ("kl_hard_stop", math.nan, "finite"),
        ("max_proxy_real_gap", math.inf, "finite"),
        ("max_proxy_real_gap", -math.inf, "finite"),
        ("max_proxy_real_gap", math.nan, "finite"),
        ("min_steps", 1.5, "an int"),
        ("min_steps", True, "an int"),
        ("min_steps", "3", "an int"),
        ("decline_patience", 0, ">= 1"),
        ("decline_patience", 1.5, ">= 1"),
        ("ema_alpha", 1.0, "[0, 1)"),
        ("ema_alpha", -1e-9, "[0, 1)"),
        ("rise_eps", math.inf, "finite"),
        ("rise_eps", math.nan, "finite"),
    ],
)
def test_guard_rejects_values_outside_or_disabling(name: str, value: object, says: str) -> None:
    with pytest.raises(ValueError) as info:
        HeldOutGuard(**{name: value})
    assert name in str(info.value) and repr(value) in str(info.value) and says in str(info.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [("kl_hard_stop", math.inf), ("max_proxy_real_gap", math.nan), ("rise_eps", math.inf)],
)
def test_guard_config_rejects_non_finite_settings(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=name):
        GuardConfig(**{name: value})


def test_zero_gap_limit_fires_on_any_unmatched_proxy_gain() -> None:
    guard = HeldOutGuard(max_proxy_real_gap=0.0, min_steps=0, ema_alpha=0.0)
    assert guard.update(0, 0.5, 0.5).fire is False  # gap 0 is not > 0
    status = guard.update(1, 0.6, 0.5)  # gap (0.6 - 0.5) - (0.5 - 0.5) = 0.1 > 0
    assert status.fire is True
    assert status.proxy_real_gap == pytest.approx(0.1)
    assert "max_proxy_real_gap 0" in status.reason


def test_negative_gap_limit_fires_unless_held_out_outgains_the_proxy() -> None:
    flat = HeldOutGuard(max_proxy_real_gap=-0.01, min_steps=0, ema_alpha=0.0)
    assert flat.update(0, 0.5, 0.5).fire is True  # gap 0 > -0.01
    outgaining = HeldOutGuard(max_proxy_real_gap=-0.01, min_steps=2, ema_alpha=0.0)
    outgaining.update(0, 0.5, 0.5)
    status = outgaining.update(1, 0.5, 0.55)  # gap 0 - 0.05 = -0.05, not > -0.01
    assert status.fire is False and status.proxy_real_gap == pytest.approx(-0.05)


def test_negative_min_steps_behaves_like_zero() -> None:
    for min_steps in (-3, 0):
        guard = HeldOutGuard(min_steps=min_steps, kl_hard_stop=0.05, ema_alpha=0.0)
        status = guard.update(0, 0.5, 0.5, kl_to_init=0.1)
        assert status.fire is True and "kl_hard_stop" in status.reason
    waiting = HeldOutGuard(min_steps=2, kl_hard_stop=0.05, ema_alpha=0.0)
    assert waiting.update(0, 0.5, 0.5, kl_to_init=0.1).fire is False


def test_negative_rise_eps_only_makes_the_streak_grow_sooner() -> None:
    def run(rise_eps: float) -> list[int]:
        guard = HeldOutGuard(
            rise_eps=rise_eps,
            decline_patience=2,
            min_steps=0,
            ema_alpha=0.0,
            max_proxy_real_gap=10.0,
        )
        streaks = []
        for step in range(3):
            status = guard.update(step, 0.5, 0.5)  # a perfectly flat run
            streaks.append(guard.decline_streak)
        assert status.fire is (rise_eps < 0)
        return streaks

    # flat moves by 0 > -1e-3: counted as in-loop rising AND held-out declining
    assert run(-1e-3) == [0, 1, 2]
    assert run(0.0) == [0, 0, 0]
