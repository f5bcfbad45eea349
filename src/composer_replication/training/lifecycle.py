"""The run lifecycle every backend shares: run directory, metrics, held-out evaluation and
the kill switch, report, final model, summary, and how a run ends.

A backend (the native loop, the trl trainer) owns only its steps. Around them,
:class:`RunLifecycle`:

- creates the run directory (after the policy has loaded: a failed start leaves nothing),
  holds it for this run alone while the run works in it (:meth:`RunLifecycle.exclusive`: a
  second run on the same directory is refused), and, at :meth:`RunLifecycle.begin`, writes ``config.json`` (a new run moves a previous
  run's record found there to ``previous/<UTC time>/`` first);
- evaluates held-out pass@1 over every environment's held-out tasks (seeded sampling,
  common random numbers before/after) at the start and every ``eval.every`` steps, and
  feeds each evaluation to the ``HeldOutGuard`` kill switch (held-out score,
  in-loop reward, token-mean KL to the initial policy); each evaluation row also carries
  ``heldout/pass@k`` (unbiased estimator, k up to ``eval.samples_per_task``) and, with
  ``eval.greedy``, ``heldout/greedy_pass@1``;
- appends one metrics row per step (``metrics.jsonl``, trackers);
- finishes the same way for every backend: ``report/`` plots, ``final_model/`` (a plain
  Hugging Face directory, LoRA merged) and ``summary.json``; a fired kill switch then
  raises :class:`~composer_replication.safety.CollapseStopError` (exit code
  :data:`EXIT_KILL_SWITCH` from the CLI).

With several training ranks (``torch.distributed`` initialised: ``torchrun``, ``accelerate
launch``), rank 0 alone writes files, held-out evaluation is split across the ranks and
gathered (every rank computes the same scores), and every stop decision is rank 0's
(:class:`~composer_replication.distributed.ranks.RankGroup`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.common.atomic_io import write_text_atomic

# the exit codes of ``composer-replication train`` (every command's: ``errors``)
from composer_replication.common.errors import EXIT_KILL_SWITCH as EXIT_KILL_SWITCH
from composer_replication.common.errors import EXIT_OK as EXIT_OK
from composer_replication.common.errors import EXIT_USAGE as EXIT_USAGE
from composer_replication.distributed.ranks import RankGroup

if TYPE_CHECKING:
    from composer_replication.config.run import RunConfig
    from composer_replication.roles import Sampler
    from composer_replication.safety import TripwireStatus

BACKENDS = ("native", "trl")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldoutTasks:
    """One environment's held-out tasks and how long their answers may be."""

    env: Any
    task_ids: list[str]
    max_new_tokens: int


@dataclass
class RunResult:
    """How a run ended (``summary.json`` holds the same facts)."""

    run_dir: Path
    steps: int
    heldout_before: float | None
    heldout_after: float | None
    final_model_dir: Path | None
    stopped_by_guard: str | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)


class RunLifecycle:
    """Run directory, evaluation + kill switch, metrics and the end of a run."""

    def __init__(
        self,
        config: RunConfig,
        *,
        backend: str,
        run_dir: str | Path | None = None,
        ranks: RankGroup | None = None,
    ):
        from composer_replication.common.metrics import MemoryMetricsLog, MetricsLog
        from composer_replication.safety import HeldOutGuard

        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
        self.config = config
        self.backend = backend
        self.ranks = ranks or RankGroup.current()
        self.run_dir = Path(run_dir or config.output_dir)
        self.metrics: MetricsLog | MemoryMetricsLog
        if self.ranks.is_writer:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.metrics = MetricsLog(
                self.run_dir / "metrics.jsonl",
                trackers=config.trackers,
                run_name=self.run_dir.name,
            )
        else:
            self.metrics = MemoryMetricsLog()
        self.guard = HeldOutGuard(**config.guard.guard_kwargs())
        self.heldout_before: float | None = None
        # how the start evaluation was had: "measured", "reused" (eval.reuse_start), None
        self.start_evaluation: str | None = None
        self.heldout_hack_fraction = 0.0
        # the last evaluation's other scores (pass@k, greedy pass@1), written beside pass@1
        self.heldout_scores: dict[str, float] = {}
        self.stopped: TripwireStatus | None = None
        self.hack_streak = 0
        # the step max_wall_seconds made the last one (None: the budget did not end the run)
        self.out_of_time_step: int | None = None
        self._start = time.perf_counter()

    # ------------------------------------------------------------------ evaluation

    def evaluate(
        self,
        sampler: Sampler,
        tokenizer: Any,
        tasks: Sequence[HeldoutTasks],
        *,
        step: int | None = None,
    ) -> float:
        """Held-out pass@1 of ``sampler`` over every environment's held-out tasks, as
        ``eval`` asks (the :class:`~composer_replication.roles.Evaluator` role), sampled in
        ``eval.sampling_dtype`` when the policy samples in this process.

        The sampled pass@1 is returned (the kill switch's signal); pass@k for the other k
        of ``reported_ks(eval.samples_per_task)``, with ``eval.greedy`` greedy pass@1, and
        for agent episodes what they did (``heldout/agent/...``: turns, tool calls, parse
        failures, end reasons) are kept in ``heldout_scores`` under their metric names.
        With ``save_rollouts`` "eval" or "all", the rollouts of evaluation ``step`` are
        written to ``rollouts/eval_step_<step>.jsonl``.
        """
        from composer_replication.envs import pass_at_1
        from composer_replication.evals.heldout import (
            configured_evaluation_rollouts,
            evaluated,
            groups_pass_at_k,
        )
        from composer_replication.evals.pass_at_k import reported_ks
        from composer_replication.inference.decoding.generate import evaluation_precision

        ev = self.config.eval
        groups: list[Any] = []
        greedy_groups: list[Any] = []
        for item in tasks:
            # each rank samples its share of the (capped) tasks; all get every group back
            task_ids = item.task_ids[: ev.max_tasks] if ev.max_tasks else list(item.task_ids)
            with evaluation_precision(ev.sampling_dtype):
                sampled, greedy = configured_evaluation_rollouts(
                    item.env,
                    sampler,
                    tokenizer,
                    self.ranks.share(task_ids),
                    ev,
                    max_new_tokens=item.max_new_tokens,
                )
            groups += self.ranks.gather_shares(sampled, len(task_ids))
            if greedy is not None:
                greedy_groups += self.ranks.gather_shares(greedy, len(task_ids))
        attempts = [r for group in groups for r in group if not r.infrastructure_error]
        # the held-out set is the kill switch's real signal: gaming it must show
        self.heldout_hack_fraction = (
            sum(bool(r.hack_flags) for r in attempts) / len(attempts) if attempts else 0.0
        )
        more_ks = [k for k in reported_ks(ev.samples_per_task) if k > 1]
        self.heldout_scores = {
            f"heldout/pass@{k}": v for k, v in groups_pass_at_k(groups, more_ks).items()
        }
        if ev.greedy:
            self.heldout_scores["heldout/greedy_pass@1"] = pass_at_1(greedy_groups)
        from composer_replication.rollout.agent import episode_metrics

        self.heldout_scores.update(
            episode_metrics([r for g in groups for r in g], prefix="heldout/agent/")
        )
        if step is not None:
            self.save_rollouts("eval", step, evaluated(groups, greedy_groups), tokenizer)
        return pass_at_1(groups)

    def save_rollouts(
        self, kind: str, step: int, groups: Sequence[Sequence[Any]], tokenizer: Any
    ) -> Path | None:
        """Write ``groups`` to ``rollouts/<kind>_step_<step>.jsonl`` when ``save_rollouts``
        asks for ``kind`` ("eval" or "train"), rank 0 only; the path written, or None."""
        wanted = {"none": (), "eval": ("eval",), "all": ("eval", "train")}
        if kind not in wanted[self.config.save_rollouts] or not self.ranks.is_writer:
            return None
        from composer_replication.samples.rollout_log import write_rollouts

        return write_rollouts(
            self._rollouts_path(kind, step), [r for group in groups for r in group], tokenizer
        )

    def exclusive(self) -> contextlib.AbstractContextManager[Any]:
        """Hold the run directory for this run alone (rank 0; ``training.run_lock``): entered
        before a run reads or moves anything there, left after its last file.

        Raises:
            RunDirectoryBusy: another live run holds it (one line: the directory, the
                holder, the fix).
        """
        from composer_replication.training.run_lock import RunDirectoryLock

        return RunDirectoryLock(self.run_dir) if self.ranks.is_writer else contextlib.nullcontext()

    def begin(self, *, resumed: bool) -> Path | None:
        """Start the run's record: a new run first moves a previous run's record found in
        the run directory to ``previous/<UTC time>/`` (returned; see
        :mod:`~composer_replication.training.run_record`), then ``config.json`` is written.
        A resumed run keeps its record (its rows past the checkpoint are already dropped)."""
        from composer_replication.training.run_record import set_aside_previous_run

        moved = None
        if self.ranks.is_writer:
            if not resumed:
                moved = set_aside_previous_run(self.run_dir)
                if moved is not None:
                    log.warning(
                        "%s held a previous run; its record is now in %s (pass --resume to "
                        "continue a run instead of starting a new one)",
                        self.run_dir,
                        moved,
                    )
            write_text_atomic(self.run_dir / "config.json", self.config.model_dump_json(indent=2))
        return moved

    def evaluate_start(
        self,
        sampler: Sampler,
        tokenizer: Any,
        tasks: Sequence[HeldoutTasks],
        *,
        policy: Any = None,
    ) -> None:
        """The initial policy's held-out pass@1 (when ``eval.at_start``), as step 0.

        With ``policy`` (the model ``sampler`` samples) and ``eval.reuse_start``, a single
        process reads back the same evaluation kept by an earlier run instead of sampling it
        again, and keeps the one it measures (:mod:`~composer_replication.evals.start_reuse`).
        """
        if not self.config.eval.at_start:
            return
        key = None
        if policy is not None and self.config.eval.reuse_start and not self.ranks.distributed:
            from composer_replication.evals.start_reuse import start_evaluation_key

            key = start_evaluation_key(self.config, policy, tokenizer, tasks)
        self.start_evaluation = "reused"
        if key is None or not self._reuse_start(key):
            self.start_evaluation = "measured"
            self.heldout_before = self.evaluate(sampler, tokenizer, tasks, step=0)
            if key is not None:
                self._keep_start(key)
        self.append(
            {
                "step": 0,
                "heldout/pass@1": self.heldout_before,
                **self.heldout_scores,
                "heldout/hack_flagged_fraction": self.heldout_hack_fraction,
            }
        )

    def _reuse_start(self, key: str) -> bool:
        """Take the start evaluation kept under ``key``; False when there is none to take
        (or it lacks the rollouts this run saves)."""
        from composer_replication.evals.start_reuse import load_start_evaluation

        kept = load_start_evaluation(key)
        rollouts = self._start_rollouts_path()
        if kept is None or (rollouts is not None and kept.rollouts is None):
            return False
        if rollouts is not None and kept.rollouts is not None:
            rollouts.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(rollouts, kept.rollouts.read_text())
        self.heldout_before = kept.pass_at_1
        self.heldout_scores = dict(kept.scores)
        self.heldout_hack_fraction = kept.hack_fraction
        log.info("held-out evaluation (start): reused the one measured on %s", kept.created)
        return True

    def _keep_start(self, key: str) -> None:
        from composer_replication.evals.start_reuse import store_start_evaluation

        assert self.heldout_before is not None
        rollouts = self._start_rollouts_path()
        store_start_evaluation(
            key,
            self.heldout_before,
            self.heldout_scores,
            self.heldout_hack_fraction,
            rollouts if rollouts is not None and rollouts.is_file() else None,
        )

    def _start_rollouts_path(self) -> Path | None:
        """Where the start evaluation's rollouts go (None: this run does not save them)."""
        if self.config.save_rollouts == "none" or not self.ranks.is_writer:
            return None
        return self._rollouts_path("eval", 0)

    def _rollouts_path(self, kind: str, step: int) -> Path:
        return self.run_dir / "rollouts" / f"{kind}_step_{step:04d}.jsonl"

    def is_eval_step(self, step: int) -> bool:
        return step % self.config.eval.every == 0 or self.is_last_step(step)

    def is_last_step(self, step: int) -> bool:
        """Step ``steps``, or the step ``max_wall_seconds`` ran out in (see
        :meth:`close_step_if_out_of_time`)."""
        return step == self.config.steps or step == self.out_of_time_step

    def close_step_if_out_of_time(self, step: int) -> bool:
        """Make ``step`` the run's last when ``max_wall_seconds`` has passed (rank 0's
        clock decides for every rank); True when it did."""
        budget = self.config.max_wall_seconds
        if budget is None or step >= self.config.steps:
            return False
        if self.ranks.agree(time.perf_counter() - self._start >= budget):
            self.out_of_time_step = step
            return True
        return False

    def guard_round(
        self,
        step: int,
        row: dict[str, Any],
        heldout: float,
        *,
        kl_to_init: float | None = None,
    ) -> bool:
        """Record an evaluation in ``row`` and feed the kill switch; True when it fired."""
        row["heldout/pass@1"] = heldout
        row.update(self.heldout_scores)
        row["heldout/hack_flagged_fraction"] = self.heldout_hack_fraction
        if kl_to_init is not None:
            row["kl/to_init"] = kl_to_init
        if not self.config.guard.enabled:
            return False
        status = self.ranks.agree(
            self.guard.update(
                step,
                float(row.get("reward/mean", 0.0)),
                heldout,
                kl_to_init=kl_to_init,
                entropy=row.get("entropy"),
            )
        )
        row.update(
            {
                "guard/fired": status.fire,
                "guard/reason": status.reason,
                "guard/proxy_real_gap": status.proxy_real_gap,
            }
        )
        if status.fire:
            self.stopped = status
        return status.fire

    def numeric_round(self, step: int, row: dict[str, Any]) -> bool:
        """The numeric guard: True (and the run stops) when the step's loss, a component or
        the gradient norm was NaN or infinite (the learner then applied no update); with
        ``guard.non_finite = "skip"`` (or the guard disabled) the step is counted and the
        run goes on."""
        bad = row.get("guard/non_finite")
        if bad is None:
            return False
        if self.config.guard.non_finite == "skip" or not self.config.guard.enabled:
            row["guard/non_finite_skipped"] = 1.0
            log.warning("step %d: non-finite %s; its update was skipped", step, bad)
            return False
        return self._stop(
            step,
            row,
            f"non-finite loss at step {step}: {bad}; that step's update was not applied "
            "(guard.non_finite = 'skip' drops such steps and goes on)",
        )

    def hack_round(self, step: int, row: dict[str, Any]) -> bool:
        """The hack tripwire: True (and the run stops) when the share of flagged rollouts
        stayed above ``guard.hack_fraction_stop`` for ``guard.hack_patience`` steps."""
        limit = self.config.guard.hack_fraction_stop
        if not self.config.guard.enabled or limit is None or "hack/flagged_fraction" not in row:
            return False
        share = float(self.ranks.agree(row["hack/flagged_fraction"]))
        self.hack_streak = self.hack_streak + 1 if share > limit else 0
        row["guard/hack_streak"] = self.hack_streak
        if self.hack_streak < self.config.guard.hack_patience:
            return False
        return self._stop(
            step,
            row,
            f"hack flags on {share:.0%} of the rollouts (limit {limit:.0%}) for "
            f"{self.hack_streak} steps in a row: the policy games its grader",
        )

    def _stop(self, step: int, row: dict[str, Any], reason: str) -> bool:
        """Stop the run at ``step`` for ``reason`` (a tripwire of the lifecycle's own; the
        held-out guard's state is carried into the status); True."""
        from composer_replication.safety import TripwireStatus

        last = self.guard.last_status
        self.stopped = TripwireStatus(
            fire=True,
            reason=reason,
            step=step,
            proxy_real_gap=self.guard.proxy_real_gap(),
            in_loop_ema=last.in_loop_ema if last else 0.0,
            heldout_ema=last.heldout_ema if last else 0.0,
            kl_ema=last.kl_ema if last else None,
        )
        row.update({"guard/fired": True, "guard/reason": reason})
        return True

    # ------------------------------------------------------------------ metrics and state

    def append(self, row: dict[str, Any]) -> None:
        from composer_replication.common.metrics import peak_rss_gb

        row["time/total_s"] = time.perf_counter() - self._start
        row["memory/peak_rss_gb"] = peak_rss_gb()
        self.metrics.append(row)

    def heldout_last(self) -> float | None:
        return next(
            (
                r["heldout/pass@1"]
                for r in reversed(self.metrics.rows())
                if r.get("heldout/pass@1") is not None
            ),
            None,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "guard": self.guard.state_dict(),
            "heldout_before": self.heldout_before,
            "start_evaluation": self.start_evaluation,
            "hack_streak": self.hack_streak,
        }

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        self.guard.load_state_dict(state["guard"])
        self.heldout_before = state["heldout_before"]
        self.start_evaluation = state.get("start_evaluation")
        self.hack_streak = int(state.get("hack_streak", 0))
        self.metrics.truncate_after(step)

    # ------------------------------------------------------------------ the end

    def write_report(self) -> None:
        """Plots of the metrics so far (also after a failure: whatever ran is shown)."""
        from composer_replication.training.report import write_report

        if self.ranks.is_writer and self.metrics.rows():
            write_report(self.run_dir)

    def finish(self, policy: Any, tokenizer: Any, steps: int) -> RunResult:
        """Final model, summary and result; raises ``CollapseStopError`` if the kill switch
        fired (after writing both, so the stopped model sits next to its metrics)."""
        from composer_replication.model.loading import save_checkpoint
        from composer_replication.safety import CollapseStopError

        stopped = None if self.stopped is None else self.stopped.reason
        heldout_after = self.heldout_last()
        final_dir = None
        if self.ranks.is_writer:  # rank 0 alone writes the model and the summary
            final_dir = save_checkpoint(policy, self.run_dir / "final_model", tokenizer=tokenizer)
            summary = {
                "backend": self.backend,
                "steps": steps,
                "heldout_before": self.heldout_before,
                "start_evaluation": self.start_evaluation,
                "heldout_after": heldout_after,
                "final_model": str(final_dir),
                "stopped_by_guard": stopped,
                "stopped_by_time_budget": self.out_of_time_step is not None,
                "wall_time_s": time.perf_counter() - self._start,
            }
            write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        if self.stopped is not None:
            raise CollapseStopError(self.stopped)
        return RunResult(
            self.run_dir,
            steps,
            self.heldout_before,
            heldout_after,
            final_dir,
            None,
            self.metrics.rows(),
        )
