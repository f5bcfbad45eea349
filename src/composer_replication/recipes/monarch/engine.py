"""The Monarch placement (``[roles] placement = "monarch"``): the native loop's controller
with its roles on Monarch processes.

The controller is :class:`~composer_replication.training.loop.Trainer` itself (curriculum,
held-out split, the algorithms' assign/score, evaluation through the run lifecycle, the
kill switch, metrics, report, summary); only two of its parts move out of process:

- ``run_rollouts``: a step's tasks are cut into contiguous shares, one per generator
  process (:class:`~.actors.GeneratorActor`); the completions of single-turn environments
  are then graded by :class:`RemoteGrader` (the Grader role: shares for the rewarder
  processes, :class:`~.actors.RewarderActor`). Multi-turn environments come back graded
  from the generators.
- the learner: :class:`RemoteLearner` is the controller's Learner (the
  :class:`~composer_replication.roles.Learner` role): every method runs on the trainer
  process's learner (:class:`~.actors.TrainerActor`); after a step it moves the new weights,
  tagged with their version (the step number), to every generator and into the
  controller's own copy (used for evaluation and by algorithms that score with the live
  policy). Checkpoints are written by the trainer process (model, optimizer, schedule) with
  the controller's state (the learner's own among it).

Every actor call waits at most ``roles.call_timeout_s``; a dead process (its calls fail
with Monarch's supervision error within seconds) or a silent one ends the run with
:class:`ActorFailedError` naming the actor. Nothing is replaced: the last checkpoint and
``--resume`` continue the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.diloco.integration import NO_SYNC
from composer_replication.inference.decoding.generate import DecodeOptions
from composer_replication.training.loop import Trainer

if TYPE_CHECKING:
    from composer_replication.config.roles import MonarchRoles
    from composer_replication.config.run import RunConfig
    from composer_replication.samples.rollouts import Rollout
    from composer_replication.samples.wire import MicroBatch
    from composer_replication.training.lifecycle import RunResult

__all__ = [
    "ActorFailedError",
    "MonarchTrainer",
    "RemoteGrader",
    "RemoteLearner",
    "RoleMesh",
    "shares",
    "train",
]


class ActorFailedError(RuntimeError):
    """An actor died, failed or did not answer in time; ``actor`` names it."""

    def __init__(self, actor: str, message: str) -> None:
        super().__init__(f"{actor}: {message}")
        self.actor = actor


def shares(items: list[Any], n: int) -> list[list[Any]]:
    """``items`` cut into ``n`` contiguous shares whose sizes differ by at most one, in order
    (the first ``len(items) % n`` shares are one longer)."""
    base, extra = divmod(len(items), n)
    out, start = [], 0
    for k in range(n):
        size = base + (1 if k < extra else 0)
        out.append(items[start : start + size])
        start += size
    return out


class RoleMesh:
    """The run's actor processes on this host: generators, rewarders, one trainer.

    ``decode``: the decode options every generator samples with (the run's in-process
    ``[inference]`` settings), handed to each when it is built."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        roles: MonarchRoles,
        *,
        decode: DecodeOptions | None = None,
    ) -> None:
        import monarch.actor
        from composer_replication.recipes.monarch.actors import (
            GeneratorActor,
            RewarderActor,
            TrainerActor,
        )
        from monarch.actor import this_host

        self.roles = roles
        self.failures: list[str] = []
        # Monarch's default answer to a dead actor is to exit the controller; record it
        # instead, so the failed call raises here with the actor's name.
        self._previous_hook = monarch.actor.unhandled_fault_hook
        monarch.actor.unhandled_fault_hook = lambda failure: self.failures.append(str(failure))
        host = this_host()
        self.meshes: list[Any] = []
        try:
            gen_procs = self._procs(host, "generators", roles.generators)
            self.generators = gen_procs.spawn(
                "generator", GeneratorActor, config, decode or DecodeOptions()
            )
            rew_procs = self._procs(host, "rewarders", roles.rewarders)
            self.rewarders = rew_procs.spawn("rewarder", RewarderActor, config)
            trainer_procs = self._procs(host, "trainer", 1)
            self.trainer = trainer_procs.spawn("trainer", TrainerActor, config, str(run_dir))
            self.pids = {
                **{
                    f"generator {k}": self.get(self.generator(k).pid.call_one(), f"generator {k}")
                    for k in range(roles.generators)
                },
                **{
                    f"rewarder {k}": self.get(self.rewarder(k).pid.call_one(), f"rewarder {k}")
                    for k in range(roles.rewarders)
                },
                "trainer": self.get(self.trainer.pid.call_one(), "trainer"),
            }
        except BaseException:
            self.close()
            raise

    def _procs(self, host: Any, name: str, n: int) -> Any:
        procs = host.spawn_procs(per_host={"procs": n}, name=name)
        self.meshes.append(procs)
        return procs

    def generator(self, k: int) -> Any:
        return self.generators.slice(procs=k)

    def rewarder(self, k: int) -> Any:
        return self.rewarders.slice(procs=k)

    def get(self, future: Any, actor: str) -> Any:
        """The call's result, or :class:`ActorFailedError` naming ``actor``."""
        timeout = self.roles.call_timeout_s
        try:
            return future.get(timeout=timeout)
        except TimeoutError as exc:
            raise ActorFailedError(
                actor, f"no answer within {timeout:g} s (roles.call_timeout_s)"
            ) from exc
        except Exception as exc:  # Monarch's SupervisionError / ActorError
            raise ActorFailedError(actor, f"failed: {exc}") from exc

    def rollouts(
        self, env_index: int, task_ids: list[str], step: int, split_env: bool
    ) -> list[list[Rollout]]:
        """One group per task id, in order: sampled across the generators and (split
        environments) graded across the rewarders."""
        pending = [
            (k, share, self.generator(k).sample.call_one(env_index, share, step, k))
            for k, share in enumerate(shares(task_ids, self.roles.generators))
            if share
        ]
        groups = [g for k, _, fut in pending for g in self.get(fut, f"generator {k}")]
        if not split_env:
            return groups
        return RemoteGrader(self, env_index).grade_groups(groups)

    def publish(self, version: int, state: dict[str, Any]) -> None:
        """Send the learner's weights of ``version`` to every generator and wait for all."""
        futures = [
            self.generator(k).load_weights.call_one(state, version)
            for k in range(self.roles.generators)
        ]
        for k, fut in enumerate(futures):
            held = self.get(fut, f"generator {k}")
            if held != version:
                raise ActorFailedError(f"generator {k}", f"holds version {held}, not {version}")

    def close(self) -> None:
        import monarch.actor

        for procs in reversed(self.meshes):
            with contextlib.suppress(Exception):  # a dead process has nothing left to stop
                procs.stop().get(timeout=30)
        self.meshes = []
        monarch.actor.unhandled_fault_hook = self._previous_hook


class _WholeCopy:
    """The controller's policy copy is whole (never sharded): gathering it is a no-op."""

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class RemoteGrader:
    """The :class:`~composer_replication.roles.Grader` of one split environment on the
    rewarder processes: the groups cut into contiguous shares, one per rewarder."""

    def __init__(self, mesh: RoleMesh, env_index: int) -> None:
        self.mesh = mesh
        self.env_index = env_index

    def grade_groups(self, groups: Sequence[Sequence[Rollout]]) -> list[list[Rollout]]:
        mesh = self.mesh
        graded = [
            (k, mesh.rewarder(k).grade.call_one(self.env_index, [list(g) for g in share]))
            for k, share in enumerate(shares(list(groups), mesh.roles.rewarders))
            if share
        ]
        return [g for k, fut in graded for g in mesh.get(fut, f"rewarder {k}")]


class RemoteLearner:
    """The controller's :class:`~composer_replication.roles.Learner`: each method of the
    role runs on the trainer process's learner (``TrainerActor.call_learner``); after an
    update the new weights move to the generators and into the controller's copy."""

    def __init__(self, mesh: RoleMesh, policy: Any) -> None:
        self.mesh = mesh
        self.policy = policy  # the controller's copy, kept at the newest version
        self.weights = _WholeCopy()
        self.sync = NO_SYNC
        self.version = 0

    def _call(self, method: str, *args: Any) -> Any:
        return self.mesh.get(self.mesh.trainer.call_learner.call_one(method, list(args)), "trainer")

    def update(self, batches: list[MicroBatch], step: int) -> dict[str, Any]:
        row = self._call("update", batches, step)
        self.sync_weights()
        return row

    def lr(self) -> float:
        return self._call("lr")

    def kl_to_initial(self) -> float:
        return self._call("kl_to_initial")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def sync_weights(self) -> int:
        """Move the trainer's newest weights to the generators and the controller."""
        from composer_replication.recipes.monarch.actors import load_trainable_state

        version, state = self.mesh.get(self.mesh.trainer.weights.call_one(), "trainer")
        self.mesh.publish(version, state)
        load_trainable_state(self.policy, state)
        self.version = version
        return version


class MonarchTrainer(Trainer):
    """The native controller with sampling, grading and learning on Monarch processes."""

    def __init__(
        self,
        config: RunConfig,
        *,
        run_dir: str | Path | None = None,
        console: Any | None = None,
    ) -> None:
        roles = config.roles
        if roles.placement != "monarch":
            raise ValueError(
                f"roles.placement = {roles.placement!r}: MonarchTrainer needs [roles] placement "
                '= "monarch" (or --placement monarch)'
            )
        if config.diloco.enabled:
            raise ValueError(
                "diloco.enabled with the roles on monarch: DiLoCo runs with the roles in "
                "process; set diloco.enabled = false or roles.placement = in_process"
            )
        if config.inference.engine != "in_process":
            raise ValueError(
                f"inference.engine = {config.inference.engine!r} with the roles on monarch: "
                "the generator processes sample in process; set inference.engine = in_process"
            )
        if config.inference.async_level not in ("auto", 0):
            raise ValueError(
                f"inference.async_level = {config.inference.async_level} with the roles on "
                "monarch: the generator processes sample each step in turn; set async_level = 0"
            )
        try:
            import monarch.actor  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(
                "the roles on monarch need torchmonarch: pip install "
                "'composer-replication[monarch]'"
            ) from exc
        super().__init__(config, run_dir=run_dir, console=console)
        self.mesh = RoleMesh(config, self.run_dir, roles, decode=DecodeOptions.of(config.inference))
        self.learner: RemoteLearner = RemoteLearner(self.mesh, self.policy)
        self.split_envs = [_is_split(rt.env) for rt in self.runtimes]

    def steps_sampled_ahead(self) -> int:
        return 0  # the generators sample each step in turn ('auto' included)

    def run_rollouts(
        self, tasks: list[list[str]], *, batch_index: int | None = None
    ) -> list[list[list[Rollout]]]:
        # each generator seeds its share (shard_seed); batch_index is the native loop's
        return [
            self.mesh.rollouts(i, task_ids, self.step, self.split_envs[i]) if task_ids else []
            for i, task_ids in enumerate(tasks)
        ]

    def save(self) -> Path:
        saved = self.mesh.trainer.save.call_one(self.step, self.extra_state())
        return Path(self.mesh.get(saved, "trainer"))

    def resume(self) -> bool:
        restored = self.mesh.get(self.mesh.trainer.resume.call_one(), "trainer")
        if restored is not None:
            self.restore(*restored)
        self.learner.sync_weights()
        return restored is not None

    def run(self, *, resume: bool = False) -> RunResult:
        try:
            if not resume:  # one source of truth for the weights from the first step on
                self.learner.sync_weights()
            return super().run(resume=resume)
        finally:
            self.mesh.close()


def _is_split(env: Any) -> bool:
    from composer_replication.recipes.monarch.actors import is_split_environment

    return is_split_environment(env)


def train(
    config: RunConfig,
    *,
    resume: bool = False,
    console: Any | None = None,
    run_dir: str | Path | None = None,
) -> RunResult:
    """Run a training job on the Monarch engine (same results and exit paths as
    :func:`composer_replication.training.loop.train`)."""
    return MonarchTrainer(config, console=console, run_dir=run_dir).run(resume=resume)
