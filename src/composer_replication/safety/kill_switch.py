"""Run-level kill switch: stop a closed-loop training run when real capability falls.

When a policy is trained on tasks it (or its generator) produces, the in-loop reward can keep
rising while real capability falls (reward hacking, model collapse). `HeldOutGuard` watches
three signals once per evaluation round and fires (latching, fail-closed) on the first that
trips:

- (b) the token-mean KL to the initial policy leaves the healthy GRPO band. A healthy run
  climbs about 0.02 -> 0.12 nats/token, 0.08 is the top of the "good" band and > 0.5 is
  divergence, hence the default hard stop of 0.08 nats/token;
- (a) held-out score down while the in-loop (proxy) reward is up for N consecutive
  checkpoints: the reward-hacking signature of Zhao et al., "Reward Hacking in
  Self-Improving Code Agents" (ICLR 2026 RSI workshop), where 10 -> 100 optimisation steps
  raised the hacking rate from 26.4% to 57.8%;
- (c) the proxy-real gap, their "Hacking Gap" = proxy gain - real gain (73.8% of KernelBench
  and 46.8% of ALE-Bench optimisations gained on the proxy but not for real).

Held-out tests alone help only a little (EvilGenie, arXiv 2511.21654), so this guard is one
layer of defence in depth next to `HeldoutSplit` and the sandbox's hack monitor. The held-out
pool must stay anchored to real tasks never fed back into training: recursive self-training
loses the tails first, then collapses (Shumailov et al., Nature 2024).

Pure Python on purpose (no torch import): the guard runs in the trainer's main loop, in tests
and in offline analysis of metric logs alike.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

__all__ = ["CollapseStopError", "HeldOutGuard", "TripwireStatus", "kl_token_trust_filter"]

# Calibration never sets the KL limit below this, so a run whose baseline KL is exactly 0
# (e.g. the first steps from the initial policy) does not fire on float noise.
_KL_FLOOR = 1e-6

_STATE_VERSION = 1
_OPTIONAL_FLOAT_STATE = (
    "in_loop_ema",
    "heldout_ema",
    "kl_ema",
    "entropy_ema",
    "reward_std_ema",
    "in_loop_baseline",
    "heldout_baseline",
)


@dataclass(frozen=True)
class TripwireStatus:
    """The verdict of one `HeldOutGuard.update` call.

    Attributes:
        fire: True when the run must stop.
        reason: Why it fired; "" when not firing.
        step: The round index passed to `update` (not the guard's internal counter): an int,
            or the float given when it is fractional.
        proxy_real_gap: (in-loop EMA gain) - (held-out EMA gain) since the first update.
        in_loop_ema: EMA of the in-loop (proxy) reward.
        heldout_ema: EMA of the held-out score.
        kl_ema: EMA of the token-mean KL to the initial policy (nats/token); None if never
            supplied.
    """

    fire: bool
    reason: str
    step: int | float
    proxy_real_gap: float
    in_loop_ema: float
    heldout_ema: float
    kl_ema: float | None = None

    @property
    def halt(self) -> bool:
        """Alias of `fire`."""
        return self.fire


class CollapseStopError(RuntimeError):
    """Raised to stop a run whose `HeldOutGuard` fired; the message is the status's reason."""

    def __init__(self, status: TripwireStatus) -> None:
        super().__init__(status.reason)
        self.status = status

    def __reduce__(self) -> tuple[type[CollapseStopError], tuple[TripwireStatus]]:
        # Exceptions pickle via self.args (the reason string); rebuild from the status instead
        # so the error survives a trip through multiprocessing / actor boundaries.
        return (type(self), (self.status,))


def _as_scalar(value: object) -> object:
    """A 0-d tensor or array (torch, numpy: anything with `ndim == 0` and `item()`) as its
    Python number; anything else unchanged. Keeps this module free of torch."""
    if (
        not isinstance(value, (numbers.Number, str, bytes))
        and getattr(value, "ndim", None) == 0
        and callable(getattr(value, "item", None))
    ):
        return value.item()  # type: ignore[attr-defined]
    return value


def _require_real(name: str, value: object, type_error: type[Exception] = TypeError) -> float:
    """Return `value` (a real number or a 0-d tensor / array holding one) as a finite float or
    raise (NaN/inf would make every gate fail open)."""
    value = _as_scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise type_error(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return x


def _round_index(value: object) -> int | float:
    """`update`'s `round_idx`: an int, or a finite real / 0-d tensor (an integral value comes
    back as an int, a fractional one as the float given); bools and non-numbers raise."""
    value = _as_scalar(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    x = _require_real("round_idx", value)
    return int(x) if x.is_integer() else x


def _require_int(name: str, value: object, minimum: int | None) -> int:
    """`value` as an int (bools refused) that is >= `minimum` (None: any int), or raise."""
    wanted = "an int" if minimum is None else f"an int >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return int(value)


def _ema(prev: float | None, x: float, alpha: float) -> float:
    """`alpha*prev + (1-alpha)*x`; the first sample (prev None) seeds the EMA."""
    return x if prev is None else alpha * prev + (1.0 - alpha) * x


@dataclass
class HeldOutGuard:
    """Latching tripwire on in-loop reward vs held-out score and KL to the initial policy.

    Call `update` once per evaluation round; stop the run when the returned status fires
    (or call `raise_if_fired`). A fired guard never un-fires.

    Settings (the ranges of the public spec; `ValueError` at construction otherwise):
        kl_hard_stop: Limit on the EMA of the token-mean KL to the initial policy, in
            nats/token (> 0). Default 0.08, the top of the healthy GRPO band
            (0.02 -> 0.12 nats/token; > 0.5 is divergence).
        max_proxy_real_gap: Limit on `proxy_real_gap()`, the Hacking Gap of Zhao et al.
            (ICLR 2026 RSI workshop). Any finite number: 0 fires on any proxy gain the
            held-out score does not match, a negative limit fires unless the held-out score
            outgains the proxy by that much.
        min_steps: Updates before any gate may fire: EMAs are noisy at first. Any int; a value
            <= 1 lets the gates judge from the first update on.
        decline_patience: Consecutive "held-out down while in-loop up" updates that fire
            (>= 1).
        ema_alpha: Weight on the PRIOR value in every EMA, in [0, 1); 0 means no smoothing.
        rise_eps: A change of an EMA by at most this much counts as flat. Any finite number;
            a negative value makes a flat EMA count as both rising and declining, so the
            decline streak only grows faster (the guard fires sooner, never later).

    Where the validation is stricter than those ranges, on purpose: every float setting must
    be a finite real number (NaN compares false and `inf` never trips, either would switch a
    gate off without a word, so `kl_hard_stop=inf` is refused although it is > 0; to run
    without the KL gate, do not pass `kl_to_init`), and `min_steps` / `decline_patience` must
    be ints that are not bools.
    """

    kl_hard_stop: float = 0.08
    max_proxy_real_gap: float = 0.10
    min_steps: int = 20
    decline_patience: int = 3
    ema_alpha: float = 0.9
    rise_eps: float = 1e-4

    _n_updates: int = field(default=0, init=False, repr=False)
    _in_loop_ema: float | None = field(default=None, init=False, repr=False)
    _heldout_ema: float | None = field(default=None, init=False, repr=False)
    _kl_ema: float | None = field(default=None, init=False, repr=False)
    _entropy_ema: float | None = field(default=None, init=False, repr=False)
    _reward_std_ema: float | None = field(default=None, init=False, repr=False)
    _in_loop_baseline: float | None = field(default=None, init=False, repr=False)
    _heldout_baseline: float | None = field(default=None, init=False, repr=False)
    _decline_streak: int = field(default=0, init=False, repr=False)
    _fired_reason: str | None = field(default=None, init=False, repr=False)
    _last_status: TripwireStatus | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate_settings()

    def _validate_settings(self) -> None:
        # Fail at construction, not mid-run: a mistyped limit would silently disable a gate.
        kl = _require_real("kl_hard_stop", self.kl_hard_stop, ValueError)
        if kl <= 0:
            raise ValueError(
                f"kl_hard_stop must be > 0 (nats/token, token-mean KL), got {self.kl_hard_stop!r}"
            )
        # Any finite limit / epsilon / warm-up is accepted (the spec's range): smaller values
        # only make the guard fire sooner. Non-finite values are refused: they disable gates.
        _require_real("max_proxy_real_gap", self.max_proxy_real_gap, ValueError)
        _require_int("min_steps", self.min_steps, None)
        _require_int("decline_patience", self.decline_patience, 1)
        alpha = _require_real("ema_alpha", self.ema_alpha, ValueError)
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"ema_alpha must be in [0, 1), got {self.ema_alpha!r}")
        _require_real("rise_eps", self.rise_eps, ValueError)

    # ------------------------------------------------------------------ read-only state

    @property
    def last_status(self) -> TripwireStatus | None:
        """The status returned by the latest `update`, or None before the first one."""
        return self._last_status

    @property
    def n_updates(self) -> int:
        """Number of `update` calls so far (drives `min_steps`)."""
        return self._n_updates

    @property
    def decline_streak(self) -> int:
        """Current count of consecutive "held-out down while in-loop up" updates."""
        return self._decline_streak

    @property
    def fired(self) -> bool:
        """True once the guard has fired (latched)."""
        return self._fired_reason is not None

    @property
    def in_loop_ema(self) -> float | None:
        return self._in_loop_ema

    @property
    def heldout_ema(self) -> float | None:
        return self._heldout_ema

    @property
    def kl_ema(self) -> float | None:
        return self._kl_ema

    @property
    def entropy_ema(self) -> float | None:
        """EMA of the policy entropy: tracked for logging, never a gate."""
        return self._entropy_ema

    @property
    def reward_std_ema(self) -> float | None:
        """EMA of the within-group reward std: tracked for logging, never a gate."""
        return self._reward_std_ema

    @property
    def in_loop_baseline(self) -> float | None:
        """In-loop EMA after the first update (None before it)."""
        return self._in_loop_baseline

    @property
    def heldout_baseline(self) -> float | None:
        """Held-out EMA after the first update (None before it)."""
        return self._heldout_baseline

    # ------------------------------------------------------------------ the gate

    def proxy_real_gap(self) -> float:
        """Hacking Gap = proxy gain - real gain (Zhao et al., ICLR 2026 RSI workshop).

        `(in_loop_ema - in_loop_baseline) - (heldout_ema - heldout_baseline)`; 0.0 before any
        update.
        """
        if (
            self._in_loop_ema is None
            or self._heldout_ema is None
            or self._in_loop_baseline is None
            or self._heldout_baseline is None
        ):
            return 0.0
        return (self._in_loop_ema - self._in_loop_baseline) - (
            self._heldout_ema - self._heldout_baseline
        )

    def update(
        self,
        round_idx: int,
        in_loop_reward: float,
        heldout_score: float,
        kl_to_init: float | None = None,
        entropy: float | None = None,
        reward_std: float | None = None,
    ) -> TripwireStatus:
        """Fold one evaluation round into the guard and return the verdict.

        Args:
            round_idx: The caller's round/step index, reported back as `status.step`: an int,
                a float or a 0-d tensor (an integral value is reported as an int).
            in_loop_reward: Mean in-loop (proxy) reward of the round. Every metric may be a
                Python number or a 0-d tensor / array (read with `.item()`).
            heldout_score: Score on the held-out pool (`HeldoutSplit`), never trained on.
            kl_to_init: Token-mean KL to the initial policy in nats/token, i.e. the per-token
                KL averaged over response tokens. Do NOT pass a sequence-summed KL: it is
                larger by the response length and would fire at once.
            entropy: Policy entropy (tracked, never a gate).
            reward_std: Within-group reward std (tracked, never a gate).

        Raises:
            ValueError / TypeError: a metric is not a finite real number (NaN or inf would
                make the gates fail open). The guard's state is left unchanged.
        """
        step = _round_index(round_idx)
        # Validate everything before touching state, so a rejected call changes nothing.
        r = _require_real("in_loop_reward", in_loop_reward)
        h = _require_real("heldout_score", heldout_score)
        kl = None if kl_to_init is None else _require_real("kl_to_init", kl_to_init)
        ent = None if entropy is None else _require_real("entropy", entropy)
        rstd = None if reward_std is None else _require_real("reward_std", reward_std)
        if kl is not None and kl < 0:
            raise ValueError(f"kl_to_init must be >= 0 (nats/token), got {kl_to_init!r}")

        # 1. count the update
        self._n_updates += 1

        # 2. fold every supplied metric into its EMA (the first sample seeds it)
        a = self.ema_alpha
        prev_in, prev_h = self._in_loop_ema, self._heldout_ema
        self._in_loop_ema = _ema(prev_in, r, a)
        self._heldout_ema = _ema(prev_h, h, a)
        if kl is not None:
            self._kl_ema = _ema(self._kl_ema, kl, a)
        if ent is not None:
            self._entropy_ema = _ema(self._entropy_ema, ent, a)
        if rstd is not None:
            self._reward_std_ema = _ema(self._reward_std_ema, rstd, a)

        # 3. the first update fixes the baselines
        if self._in_loop_baseline is None:
            self._in_loop_baseline = self._in_loop_ema
        if self._heldout_baseline is None:
            self._heldout_baseline = self._heldout_ema

        # 4. decline streak
        in_rising = prev_in is not None and self._in_loop_ema - prev_in > self.rise_eps
        h_declining = prev_h is not None and prev_h - self._heldout_ema > self.rise_eps
        if h_declining and in_rising:
            self._decline_streak += 1
        elif not h_declining:
            self._decline_streak = 0
        # held-out declining while in-loop flat/down: streak unchanged

        # 5. verdict, first match wins
        reason = self._verdict()
        gap = self.proxy_real_gap()
        status = TripwireStatus(
            fire=bool(reason),
            reason=reason,
            step=step,
            proxy_real_gap=gap,
            in_loop_ema=self._in_loop_ema,
            heldout_ema=self._heldout_ema,
            kl_ema=self._kl_ema,
        )

        # 6. store and latch
        self._last_status = status
        if status.fire and self._fired_reason is None:
            self._fired_reason = reason
        return status

    def _verdict(self) -> str:
        """Return the firing reason, or "" for no fire."""
        if self._fired_reason is not None:
            # Quote the original reason, so repeated latched updates do not nest the prefix.
            return f"latched: {self._fired_reason}"
        if self._n_updates < self.min_steps:
            return ""
        if self._kl_ema is not None and self._kl_ema > self.kl_hard_stop:
            return (
                f"KL-to-init EMA {self._kl_ema:.6g} nats/token > kl_hard_stop "
                f"{self.kl_hard_stop:.6g} nats/token (policy left the healthy GRPO KL band)"
            )
        if self._decline_streak >= self.decline_patience:
            return (
                f"held-out EMA declined while in-loop EMA rose for {self._decline_streak} "
                f"consecutive updates (decline_patience={self.decline_patience}): "
                "reward-hacking signature"
            )
        gap = self.proxy_real_gap()
        if gap > self.max_proxy_real_gap:
            return (
                f"proxy-real gap {gap:.6g} > max_proxy_real_gap {self.max_proxy_real_gap:.6g} "
                "(in-loop reward gained without a matching held-out gain)"
            )
        return ""

    def should_halt(self) -> bool:
        """True when the last status fired. Never changes state."""
        return self._last_status is not None and self._last_status.fire

    def raise_if_fired(self, status: TripwireStatus | None = None) -> None:
        """Raise `CollapseStopError` for a fired `status` (default: `last_status`)."""
        status = self._last_status if status is None else status
        if status is not None and status.fire:
            raise CollapseStopError(status)

    def calibrate_kl_threshold(self, baseline_kls: Iterable[float], factor: float = 3.0) -> float:
        """Tighten `kl_hard_stop` to `factor * mean(baseline_kls)`; return the new limit.

        New limit = `max(min(factor * mean(baseline_kls), kl_hard_stop), 1e-6)`. It may only
        tighten: a limit already below the 1e-6 floor is kept as is. `baseline_kls` are
        token-mean KLs in nats/token measured on a healthy warm-up.

        Raises:
            ValueError: empty `baseline_kls`, `factor <= 0`, or a negative / non-finite KL.
        """
        kls = list(baseline_kls)
        if not kls:
            raise ValueError("baseline_kls is empty; pass at least one token-mean KL (nats/token)")
        f = _require_real("factor", factor)
        if f <= 0:
            raise ValueError(f"factor must be > 0, got {factor!r}")
        values = []
        for i, kl in enumerate(kls):
            x = _require_real(f"baseline_kls[{i}]", kl)
            if x < 0:
                raise ValueError(f"baseline_kls[{i}] must be >= 0 (a KL), got {kl!r}")
            values.append(x)
        proposed = f * math.fsum(values) / len(values)
        # min() with the current limit first, so the floor can never loosen a limit set below it.
        new_limit = min(self.kl_hard_stop, max(proposed, _KL_FLOOR))
        self.kl_hard_stop = new_limit
        return new_limit

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, object]:
        """JSON-serialisable snapshot of settings and state, for exact resume."""
        return {
            "version": _STATE_VERSION,
            "settings": {
                "kl_hard_stop": self.kl_hard_stop,
                "max_proxy_real_gap": self.max_proxy_real_gap,
                "min_steps": self.min_steps,
                "decline_patience": self.decline_patience,
                "ema_alpha": self.ema_alpha,
                "rise_eps": self.rise_eps,
            },
            "state": {
                "n_updates": self._n_updates,
                "in_loop_ema": self._in_loop_ema,
                "heldout_ema": self._heldout_ema,
                "kl_ema": self._kl_ema,
                "entropy_ema": self._entropy_ema,
                "reward_std_ema": self._reward_std_ema,
                "in_loop_baseline": self._in_loop_baseline,
                "heldout_baseline": self._heldout_baseline,
                "decline_streak": self._decline_streak,
                "fired_reason": self._fired_reason,
                "last_status": None if self._last_status is None else asdict(self._last_status),
            },
        }

    def load_state_dict(self, d: dict[str, object]) -> None:
        """Restore a `state_dict()` snapshot (settings included, e.g. a calibrated KL limit).

        Raises:
            ValueError: unknown version, missing keys, or invalid settings. The guard is left
                unchanged on error.
        """
        if not isinstance(d, dict) or d.get("version") != _STATE_VERSION:
            got = d.get("version") if isinstance(d, dict) else d
            raise ValueError(
                f"unsupported HeldOutGuard state_dict version {got!r}; expected "
                f"{_STATE_VERSION} (a dict from HeldOutGuard.state_dict())"
            )
        try:
            settings = dict(d["settings"])  # type: ignore[call-overload]
            state = dict(d["state"])  # type: ignore[call-overload]
            candidate = HeldOutGuard(**settings)  # validates the settings
            last = state["last_status"]
            candidate._n_updates = _require_int("n_updates", state["n_updates"], 0)
            for key in _OPTIONAL_FLOAT_STATE:
                value = state[key]
                setattr(candidate, f"_{key}", None if value is None else _require_real(key, value))
            candidate._decline_streak = _require_int("decline_streak", state["decline_streak"], 0)
            fired = state["fired_reason"]
            if fired is not None and not isinstance(fired, str):
                raise TypeError(f"fired_reason must be a str or None, got {fired!r}")
            candidate._fired_reason = fired
            candidate._last_status = None if last is None else TripwireStatus(**last)
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed HeldOutGuard state_dict: {e!r}") from e
        # Copy field by field so `self` stays the same object the trainer holds.
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(candidate, name))


def kl_token_trust_filter(logratio_sq_half: float, threshold: float = 0.08) -> bool:
    """True when a token's k2 KL estimate exceeds `threshold`, i.e. mask the token out.

    `logratio_sq_half` is the per-token k2 estimate `0.5 * (log pi - log pi_ref)^2` in nats;
    the default 0.08 is the top of the healthy GRPO token-mean KL band. A value equal to the
    threshold is kept. NaN is masked (fail closed). The trainer offers the tensor version of
    the same mask as a loss option.
    """
    if math.isnan(threshold) or threshold < 0:
        raise ValueError(f"threshold must be >= 0 (nats), got {threshold!r}")
    if math.isnan(logratio_sq_half):
        return True
    return logratio_sq_half > threshold
