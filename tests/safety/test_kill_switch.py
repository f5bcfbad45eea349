"""Tests for `composer_replication.safety.kill_switch` against hand-computed values.

Most guards use `ema_alpha` 0.5 or 0 and dyadic inputs, so every EMA is exact in binary
floating point and can be compared with `==`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import subprocess
import sys

import pytest

from composer_replication import safety
from composer_replication.safety import (
    CollapseStopError,
    HeldOutGuard,
    TripwireStatus,
    kl_token_trust_filter,
)

GAP_REASON = (
    "proxy-real gap 0.125 > max_proxy_real_gap 0.1 "
    "(in-loop reward gained without a matching held-out gain)"
)


def _gap_fired_guard() -> tuple[HeldOutGuard, TripwireStatus]:
    """A guard that fires on the proxy-real gap at its second update."""
    g = HeldOutGuard(ema_alpha=0.5, min_steps=2, max_proxy_real_gap=0.1)
    g.update(0, 0.5, 0.5)
    return g, g.update(1, 0.75, 0.5)


# ------------------------------------------------------------------ public surface


def test_all_exports() -> None:
    assert set(safety.__all__) == {
        "HeldOutGuard",
        "TripwireStatus",
        "CollapseStopError",
        "kl_token_trust_filter",
        "HeldoutSplit",
        "HeldoutLeakError",
        "HeldoutSplitMismatch",
        "DEFAULT_SPLIT",
        "check_same_split",
    }
    for name in safety.__all__:
        assert hasattr(safety, name)


def test_import_does_not_import_torch() -> None:
    code = "import composer_replication.safety, sys; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_defaults() -> None:
    g = HeldOutGuard()
    assert (g.kl_hard_stop, g.max_proxy_real_gap, g.min_steps) == (0.08, 0.10, 20)
    assert (g.decline_patience, g.ema_alpha, g.rise_eps) == (3, 0.9, 1e-4)
    assert g.last_status is None
    assert g.should_halt() is False
    assert g.proxy_real_gap() == 0.0
    assert g.n_updates == 0
    assert g.fired is False


def test_tripwire_status_fields_halt_alias_and_frozen() -> None:
    s = TripwireStatus(
        fire=True, reason="r", step=7, proxy_real_gap=0.5, in_loop_ema=1.0, heldout_ema=0.25
    )
    assert s.kl_ema is None
    assert s.halt is True
    assert TripwireStatus(False, "", 0, 0.0, 0.0, 0.0).halt is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.fire = False  # type: ignore[misc]


# ------------------------------------------------------------------ EMAs and baselines


def test_first_update_seeds_emas_and_baselines() -> None:
    g = HeldOutGuard()
    s = g.update(5, 0.3, 0.6, kl_to_init=0.01, entropy=2.0, reward_std=0.1)
    assert s == TripwireStatus(False, "", 5, 0.0, 0.3, 0.6, 0.01)
    assert (g.in_loop_baseline, g.heldout_baseline) == (0.3, 0.6)
    assert (g.entropy_ema, g.reward_std_ema) == (2.0, 0.1)
    assert g.last_status is s


def test_ema_hand_computed_default_alpha() -> None:
    g = HeldOutGuard()  # alpha 0.9: ema = 0.9*prev + 0.1*x
    g.update(0, 0.2, 0.5, kl_to_init=0.01, entropy=2.0, reward_std=0.3)
    s2 = g.update(1, 0.4, 0.3, kl_to_init=0.03, entropy=1.0, reward_std=0.1)
    assert s2.in_loop_ema == pytest.approx(0.22, abs=1e-12)
    assert s2.heldout_ema == pytest.approx(0.48, abs=1e-12)
    assert s2.kl_ema == pytest.approx(0.012, abs=1e-12)
    assert g.entropy_ema == pytest.approx(1.9, abs=1e-12)
    assert g.reward_std_ema == pytest.approx(0.28, abs=1e-12)
    # kl/entropy omitted: their EMAs keep the previous value
    s3 = g.update(2, 0.6, 0.1, reward_std=0.5)
    assert s3.in_loop_ema == pytest.approx(0.258, abs=1e-12)
    assert s3.heldout_ema == pytest.approx(0.442, abs=1e-12)
    assert s3.kl_ema == pytest.approx(0.012, abs=1e-12)
    assert g.entropy_ema == pytest.approx(1.9, abs=1e-12)
    assert g.reward_std_ema == pytest.approx(0.302, abs=1e-12)
    # baselines stay at the first update; gap = (0.258-0.2) - (0.442-0.5)
    assert (g.in_loop_baseline, g.heldout_baseline) == (0.2, 0.5)
    assert s3.proxy_real_gap == pytest.approx(0.116, abs=1e-12)
    assert g.proxy_real_gap() == s3.proxy_real_gap
    assert g.decline_streak == 2
    assert s3.fire is False  # still inside min_steps=20
    assert s3.step == 2


def test_kl_ema_is_none_until_supplied() -> None:
    g = HeldOutGuard(ema_alpha=0.5)
    assert g.update(0, 0.5, 0.5).kl_ema is None
    assert g.update(1, 0.5, 0.5, kl_to_init=0.25).kl_ema == 0.25  # first sample seeds


def test_entropy_and_reward_std_never_gate() -> None:
    g = HeldOutGuard(min_steps=0)
    s = g.update(0, 0.5, 0.5, entropy=1e9, reward_std=1e9)
    assert s.fire is False


# ------------------------------------------------------------------ (b) KL tripwire


def test_kl_tripwire_fires_strictly_above_limit() -> None:
    g = HeldOutGuard(kl_hard_stop=0.25, ema_alpha=0.5, min_steps=1)
    assert g.update(0, 0.5, 0.5, kl_to_init=0.125).kl_ema == 0.125
    s = g.update(1, 0.5, 0.5, kl_to_init=0.375)
    assert (s.kl_ema, s.fire) == (0.25, False)  # equal to the limit: not above it
    s = g.update(2, 0.5, 0.5, kl_to_init=0.5)
    assert s.kl_ema == 0.375
    assert s.fire is True
    assert s.reason == (
        "KL-to-init EMA 0.375 nats/token > kl_hard_stop 0.25 nats/token "
        "(policy left the healthy GRPO KL band)"
    )
    assert s.step == 2


# ------------------------------------------------------------------ (a) decline streak


def _streak_guard(patience: int) -> HeldOutGuard:
    # alpha 0: each EMA equals the latest sample; a huge gap limit isolates the streak gate.
    return HeldOutGuard(
        ema_alpha=0.0, min_steps=0, decline_patience=patience, max_proxy_real_gap=10.0
    )


def test_decline_streak_fires_at_patience() -> None:
    g = _streak_guard(3)
    assert g.update(0, 0.5, 0.5).fire is False
    assert (g.update(1, 0.6, 0.4).fire, g.decline_streak) == (False, 1)
    assert (g.update(2, 0.7, 0.3).fire, g.decline_streak) == (False, 2)
    s = g.update(3, 0.8, 0.2)
    assert g.decline_streak == 3
    assert s.fire is True
    assert s.reason == (
        "held-out EMA declined while in-loop EMA rose for 3 consecutive updates "
        "(decline_patience=3): reward-hacking signature"
    )


def test_decline_streak_reset_and_unchanged_rules() -> None:
    g = _streak_guard(10)
    expected = [
        ((0.5, 0.5), 0),  # first update: nothing to compare
        ((0.6, 0.4), 1),  # in-loop up, held-out down: grow
        ((0.5, 0.3), 1),  # in-loop down, held-out down: unchanged
        ((0.5, 0.2), 1),  # in-loop flat, held-out down: unchanged
        ((0.6, 0.1), 2),  # grow
        ((0.7, 0.1), 0),  # held-out flat: reset
        ((0.8, 0.0), 1),  # grow
        ((0.9, 0.05), 0),  # held-out up: reset
        ((1.0, 0.0), 1),  # grow
        ((1.00005, -0.1), 1),  # in-loop rise <= rise_eps counts as flat: unchanged
        ((1.1, -0.10005), 0),  # held-out fall <= rise_eps is not a decline: reset
    ]
    for i, ((r, h), streak) in enumerate(expected):
        s = g.update(i, r, h)
        assert g.decline_streak == streak, i
        assert s.fire is False


# ------------------------------------------------------------------ (c) proxy-real gap


def test_proxy_real_gap_tripwire() -> None:
    g, s = _gap_fired_guard()
    assert (s.in_loop_ema, s.heldout_ema) == (0.625, 0.5)
    assert s.proxy_real_gap == 0.125
    assert s.fire is True
    assert s.reason == GAP_REASON
    assert g.decline_streak == 0


def test_proxy_real_gap_equal_to_limit_does_not_fire() -> None:
    g = HeldOutGuard(ema_alpha=0.5, min_steps=2, max_proxy_real_gap=0.125)
    g.update(0, 0.5, 0.5)
    s = g.update(1, 0.75, 0.5)
    assert (s.proxy_real_gap, s.fire, s.reason) == (0.125, False, "")


# ------------------------------------------------------------------ verdict order


def _all_conditions(kl2: float, patience: int) -> TripwireStatus:
    g = HeldOutGuard(
        kl_hard_stop=0.1,
        max_proxy_real_gap=0.05,
        min_steps=0,
        decline_patience=patience,
        ema_alpha=0.0,
    )
    g.update(0, 0.5, 0.5, kl_to_init=0.0)
    return g.update(1, 0.625, 0.375, kl_to_init=kl2)  # streak 1, gap 0.25


def test_verdict_order_kl_then_streak_then_gap() -> None:
    assert _all_conditions(kl2=0.25, patience=1).reason.startswith("KL-to-init EMA 0.25 ")
    assert _all_conditions(kl2=0.0625, patience=1).reason.startswith("held-out EMA declined")
    assert _all_conditions(kl2=0.0625, patience=5).reason.startswith("proxy-real gap 0.25 ")


# ------------------------------------------------------------------ warm-up and latching


def test_min_steps_warm_up_blocks_every_gate() -> None:
    g = HeldOutGuard()  # min_steps=20
    for i in range(1, 20):
        s = g.update(i, i / 100, 1 - i / 100, kl_to_init=1.0)
        assert (s.fire, s.reason) == (False, ""), i
    assert g.decline_streak == 18  # the streak is tracked during warm-up
    s = g.update(20, 0.2, 0.8, kl_to_init=1.0)
    assert s.fire is True
    assert s.reason.startswith("KL-to-init EMA 1 nats/token > kl_hard_stop 0.08")


def test_min_steps_counts_updates_not_round_idx() -> None:
    g = HeldOutGuard(min_steps=2)
    assert g.update(1000, 0.5, 0.5, kl_to_init=1.0).fire is False
    assert g.update(2000, 0.5, 0.5, kl_to_init=1.0).fire is True
    assert HeldOutGuard(min_steps=0).update(0, 0.5, 0.5, kl_to_init=1.0).fire is True


def test_latch_keeps_firing_after_metrics_recover() -> None:
    g, _ = _gap_fired_guard()
    s = g.update(2, 0.5, 0.75)  # in-loop back down, held-out up
    assert s.proxy_real_gap == -0.0625  # (0.5625-0.5) - (0.625-0.5): no gate would fire
    assert s.fire is True
    assert s.reason == "latched: " + GAP_REASON
    s = g.update(3, 0.5, 0.75)
    assert s.reason == "latched: " + GAP_REASON  # no nested "latched: latched: "
    assert g.should_halt() is True
    assert g.fired is True


def test_should_halt_and_last_status_do_not_change_state() -> None:
    g, s = _gap_fired_guard()
    before = g.state_dict()
    for _ in range(3):
        assert g.should_halt() is True
        assert g.last_status is s
        assert g.proxy_real_gap() == 0.125
    assert g.state_dict() == before


# ------------------------------------------------------------------ stopping


def test_collapse_stop_error_carries_status() -> None:
    _, s = _gap_fired_guard()
    err = CollapseStopError(s)
    assert isinstance(err, RuntimeError)
    assert str(err) == GAP_REASON
    assert err.status is s
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.status) == (GAP_REASON, s)


def test_raise_if_fired() -> None:
    g = HeldOutGuard(ema_alpha=0.5, min_steps=2, max_proxy_real_gap=0.1)
    g.raise_if_fired()  # no status yet: nothing
    quiet = g.update(0, 0.5, 0.5)
    g.raise_if_fired()  # not fired: nothing
    fired = g.update(1, 0.75, 0.5)
    with pytest.raises(CollapseStopError, match=r"proxy-real gap 0\.125") as info:
        g.raise_if_fired()
    assert info.value.status is fired
    g.raise_if_fired(quiet)  # an explicit non-fired status does not raise
    with pytest.raises(CollapseStopError) as info:
        HeldOutGuard().raise_if_fired(fired)  # an explicit fired status raises anywhere
    assert info.value.status is fired


# ------------------------------------------------------------------ calibration


def test_calibrate_tightens_only_and_floors() -> None:
    g = HeldOutGuard()
    assert g.calibrate_kl_threshold([0.0078125, 0.0234375]) == 0.046875  # 3 * 0.015625
    assert g.kl_hard_stop == 0.046875
    assert g.calibrate_kl_threshold([0.5]) == 0.046875  # would loosen: kept
    assert g.calibrate_kl_threshold([0.0078125], factor=2.0) == 0.015625
    assert g.calibrate_kl_threshold([0.0, 0.0]) == 1e-6  # floor
    assert g.kl_hard_stop == 1e-6


def test_calibrate_never_loosens_a_limit_below_the_floor() -> None:
    g = HeldOutGuard(kl_hard_stop=1e-9)
    assert g.calibrate_kl_threshold([0.0]) == 1e-9


def test_calibrated_limit_is_used_by_the_gate() -> None:
    g = HeldOutGuard(min_steps=0, ema_alpha=0.0)
    g.calibrate_kl_threshold([0.0078125])  # -> 0.0234375
    assert g.update(0, 0.5, 0.5, kl_to_init=0.0234375).fire is False
    assert g.update(1, 0.5, 0.5, kl_to_init=0.03125).fire is True


@pytest.mark.parametrize(
    ("kls", "factor", "match"),
    [
        ([], 3.0, "baseline_kls is empty"),
        ([0.01], 0.0, "factor must be > 0, got 0.0"),
        ([0.01], -1.0, "factor must be > 0, got -1.0"),
        ([0.01, -0.001], 3.0, r"baseline_kls\[1\] must be >= 0 \(a KL\), got -0.001"),
        ([0.01, math.nan], 3.0, r"baseline_kls\[1\] must be a finite number, got nan"),
    ],
)
def test_calibrate_rejects_bad_input(kls: list[float], factor: float, match: str) -> None:
    g = HeldOutGuard()
    with pytest.raises(ValueError, match=match):
        g.calibrate_kl_threshold(kls, factor=factor)
    assert g.kl_hard_stop == 0.08


# ------------------------------------------------------------------ settings validation


@pytest.mark.parametrize(
    ("name", "value", "valid"),
    [
        ("kl_hard_stop", 0.0, "> 0"),
        ("kl_hard_stop", -0.1, "> 0"),
        ("kl_hard_stop", math.nan, "finite"),
        ("kl_hard_stop", math.inf, "finite"),
        ("kl_hard_stop", "0.08", "real number"),
        ("max_proxy_real_gap", math.nan, "finite"),
        ("max_proxy_real_gap", math.inf, "finite"),
        ("min_steps", 2.5, "an int"),
        ("min_steps", True, "an int"),
        ("decline_patience", 0, ">= 1"),
        ("decline_patience", -3, ">= 1"),
        ("decline_patience", 1.5, ">= 1"),
        ("ema_alpha", -0.1, "[0, 1)"),
        ("ema_alpha", 1.0, "[0, 1)"),
        ("ema_alpha", 1.5, "[0, 1)"),
        ("ema_alpha", math.nan, "finite"),
        ("rise_eps", math.inf, "finite"),
        ("rise_eps", math.nan, "finite"),
    ],
)
def test_invalid_settings_raise_value_error(name: str, value: object, valid: str) -> None:
    with pytest.raises(ValueError) as info:
        HeldOutGuard(**{name: value})
    message = str(info.value)
    assert name in message
    assert repr(value) in message
    assert valid in message


def test_boundary_settings_are_valid() -> None:
    g = HeldOutGuard(
        kl_hard_stop=1e-9,
        max_proxy_real_gap=1e-9,
        min_steps=0,
        decline_patience=1,
        ema_alpha=0.0,
        rise_eps=0.0,
    )
    assert g.update(0, 0.5, 0.5).fire is False


# ------------------------------------------------------------------ update input validation


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"in_loop_reward": math.nan}, ValueError, "in_loop_reward must be a finite number"),
        ({"heldout_score": math.inf}, ValueError, "heldout_score must be a finite number"),
        ({"kl_to_init": math.nan}, ValueError, "kl_to_init must be a finite number"),
        ({"kl_to_init": -0.01}, ValueError, "kl_to_init must be >= 0"),
        ({"entropy": math.nan}, ValueError, "entropy must be a finite number"),
        ({"reward_std": "0.1"}, TypeError, "reward_std must be a real number"),
        ({"round_idx": "3"}, TypeError, "round_idx must be a real number"),
        ({"round_idx": math.nan}, ValueError, "round_idx must be a finite number"),
    ],
)
def test_update_rejects_bad_metrics_without_changing_state(
    kwargs: dict[str, object], exc: type[Exception], match: str
) -> None:
    g = HeldOutGuard()
    g.update(0, 0.5, 0.5)
    before = g.state_dict()
    args: dict[str, object] = {"round_idx": 1, "in_loop_reward": 0.5, "heldout_score": 0.5}
    with pytest.raises(exc, match=match):
        g.update(**{**args, **kwargs})  # type: ignore[arg-type]
    assert g.state_dict() == before


# ------------------------------------------------------------------ checkpoint / resume

METRICS = [
    (0.50, 0.50, 0.010),
    (0.55, 0.49, 0.012),
    (0.60, 0.47, 0.015),
    (0.62, 0.46, None),
    (0.65, 0.44, 0.020),
    (0.70, 0.43, 0.021),
    (0.72, 0.40, 0.022),
    (0.75, 0.41, 0.024),
    (0.80, 0.38, 0.025),
    (0.85, 0.35, 0.030),
]


def _feed(g: HeldOutGuard, rows: list[tuple[float, float, float | None]], start: int) -> list:
    return [
        g.update(
            start + i, r, h, kl_to_init=kl, entropy=1.0 + start + i, reward_std=0.1 * (start + i)
        )
        for i, (r, h, kl) in enumerate(rows)
    ]


@pytest.mark.parametrize("cut", [0, 3, 5, 8])
def test_state_dict_round_trip_continues_identically(cut: int) -> None:
    def fresh() -> HeldOutGuard:
        g = HeldOutGuard(ema_alpha=0.7, min_steps=3, decline_patience=3)
        g.calibrate_kl_threshold([0.004, 0.006])  # -> 0.015: part of the checkpoint
        return g

    reference = fresh()
    expected = _feed(reference, METRICS, 0)
    assert any(s.fire for s in expected)  # the run fires, then latches

    first = fresh()
    _feed(first, METRICS[:cut], 0)
    blob = json.dumps(first.state_dict(), allow_nan=False)  # strict JSON
    resumed = HeldOutGuard()  # default settings: all restored from the checkpoint
    resumed.load_state_dict(json.loads(blob))
    assert resumed.state_dict() == first.state_dict()
    assert resumed.kl_hard_stop == pytest.approx(0.015, abs=1e-15)
    assert resumed.last_status == first.last_status
    assert _feed(resumed, METRICS[cut:], cut) == expected[cut:]
    assert resumed.state_dict() == reference.state_dict()


def test_state_dict_round_trip_keeps_latch() -> None:
    g, _ = _gap_fired_guard()
    resumed = HeldOutGuard()
    resumed.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert resumed.should_halt() is True
    assert resumed.update(2, 0.0, 1.0).reason == "latched: " + GAP_REASON


def test_load_state_dict_rejects_bad_input_and_keeps_state() -> None:
    g, s = _gap_fired_guard()
    good = g.state_dict()
    with pytest.raises(ValueError, match="unsupported HeldOutGuard state_dict version 99"):
        g.load_state_dict({**good, "version": 99})
    with pytest.raises(ValueError, match="malformed HeldOutGuard state_dict"):
        g.load_state_dict({"version": 1, "settings": good["settings"]})
    bad_settings = {**good["settings"], "ema_alpha": 1.5}  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"ema_alpha must be in \[0, 1\), got 1.5"):
        g.load_state_dict({**good, "settings": bad_settings})
    bad_state = {**good["state"], "in_loop_ema": "high"}  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="malformed"):
        g.load_state_dict({**good, "state": bad_state})
    assert g.state_dict() == good
    assert g.last_status is s


# ------------------------------------------------------------------ per-token trust filter


def test_kl_token_trust_filter_boundaries() -> None:
    assert kl_token_trust_filter(0.08) is False  # equal to the threshold: kept
    assert kl_token_trust_filter(math.nextafter(0.08, 1.0)) is True
    assert kl_token_trust_filter(0.0) is False
    assert kl_token_trust_filter(0.5 * 0.5**2) is True  # log-ratio 0.5 -> k2 0.125
    assert kl_token_trust_filter(0.5 * 0.25**2) is False  # log-ratio 0.25 -> k2 0.03125
    assert kl_token_trust_filter(0.0, threshold=0.0) is False
    assert kl_token_trust_filter(1e-12, threshold=0.0) is True
    assert kl_token_trust_filter(0.3, threshold=0.5) is False
    assert kl_token_trust_filter(math.inf) is True
    assert kl_token_trust_filter(math.nan) is True  # fail closed: mask it


@pytest.mark.parametrize("threshold", [-0.01, math.nan])
def test_kl_token_trust_filter_rejects_bad_threshold(threshold: float) -> None:
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        kl_token_trust_filter(0.1, threshold=threshold)


# ------------------------------------------------------------------ 0-d tensors, float rounds


def test_update_takes_0d_tensors_and_float_rounds_as_the_documented_loop_passes_them() -> None:
    torch = pytest.importorskip("torch")
    guard = HeldOutGuard(kl_hard_stop=0.08)
    plain = HeldOutGuard(kl_hard_stop=0.08)
    num_generations = 4
    for rnd in range(num_generations):
        r_proxy = torch.tensor(0.5 + 0.1 * rnd)
        r_real = torch.tensor(0.5, dtype=torch.float64)
        token_mean_kl_value = torch.tensor(0.01 * rnd)
        status = guard.update(
            rnd, in_loop_reward=r_proxy, heldout_score=r_real, kl_to_init=token_mean_kl_value
        )
        same = plain.update(
            rnd, r_proxy.item(), r_real.item(), kl_to_init=token_mean_kl_value.item()
        )
        assert status == same and type(status.in_loop_ema) is float
        if status.fire:  # or: guard.should_halt()
            guard.raise_if_fired(status)
    assert guard.state_dict() == plain.state_dict()
    assert guard.update(4.0, 0.9, 0.5).step == 4 and type(guard.last_status.step) is int
    assert guard.update(torch.tensor(5), 0.9, 0.5).step == 5
    assert guard.update(5.5, 0.9, 0.5).step == 5.5
    with pytest.raises(TypeError, match="in_loop_reward must be a real number"):
        guard.update(6, torch.tensor([0.5, 0.6]), 0.5)  # not a scalar
    with pytest.raises(ValueError, match="kl_to_init must be a finite number"):
        guard.update(6, 0.5, 0.5, kl_to_init=torch.tensor(float("nan")))
