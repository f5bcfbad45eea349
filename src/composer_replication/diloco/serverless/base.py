"""What every serverless executor shares: the handle, the Protocol, entrypoint, launch and
collect helpers.

An executor starts ``n`` replicas of one entrypoint somewhere (local processes, a
Kubernetes Indexed Job, SageMaker training jobs, Modal functions, HF Jobs) and tells each
its rank. The replicas never need a network between them: they meet through an
``ObjectStoreAllReduce`` rendezvous URI passed in ``entrypoint_args``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from composer_replication.config.diloco import RANK_ENV as RANK_ENV
from composer_replication.config.diloco import WORLD_SIZE_ENV as WORLD_SIZE_ENV

#: What an empty entrypoint (``""``, the documented way to say "the default") runs.
DEFAULT_ENTRYPOINT = "composer_replication.diloco.serverless.replica_entrypoint"

#: "gone": the record names a process that is not there any more and left no exit code, its
#: pid now another process's (a local replica's state file outliving it)
ReplicaStatus = Literal["pending", "running", "succeeded", "failed", "cancelled", "gone"]
STATUSES: tuple[str, ...] = ("pending", "running", "succeeded", "failed", "cancelled", "gone")
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled", "gone"})


@dataclass(frozen=True)
class ReplicaHandle:
    """One launched replica: its rank, the backend that runs it and backend ids."""

    rank: int
    backend_name: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "backend_name": self.backend_name, "metadata": self.metadata}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaHandle:
        return cls(int(data["rank"]), str(data["backend_name"]), dict(data.get("metadata", {})))


@runtime_checkable
class ServerlessExecutor(Protocol):
    """Launches and tracks the replicas of one DiLoCo run on one backend."""

    backend_name: str
    supports_inter_replica_network: bool

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: Any,
        entrypoint_args: dict[str, Any],
        *,
        gpu: str | None = None,
        timeout: int = 3600,
    ) -> list[ReplicaHandle]: ...

    def poll(self, handle: ReplicaHandle) -> ReplicaStatus: ...

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str: ...

    def cancel(self, handle: ReplicaHandle) -> None: ...

    def collect(
        self, handles: list[ReplicaHandle], *, timeout: float | None = None
    ) -> list[dict[str, Any]]: ...


def check_launch_args(n_replicas: int, timeout: float) -> None:
    """Reject a replica count or timeout no backend can honour."""
    if isinstance(n_replicas, bool) or not isinstance(n_replicas, int) or n_replicas < 1:
        raise ValueError(f"n_replicas must be an int >= 1, got {n_replicas!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")


def resolve_entrypoint(entrypoint: str | Callable[..., Any]) -> Callable[..., Any]:
    """A callable from ``"pkg.module"`` (its ``main``), ``"pkg.module.function"`` or a callable;
    ``""`` is the default entry point (``DEFAULT_ENTRYPOINT``'s ``main``)."""
    if callable(entrypoint):
        return entrypoint
    if entrypoint == "":
        entrypoint = DEFAULT_ENTRYPOINT
    if not isinstance(entrypoint, str) or not entrypoint:
        raise ValueError(
            f"entrypoint must be a callable or a 'module' / 'module.function' string, "
            f"got {entrypoint!r}"
        )
    try:
        module = importlib.import_module(entrypoint)
        attr = "main"
    except ModuleNotFoundError as exc:
        module_name, _, attr = entrypoint.rpartition(".")
        if not module_name or exc.name not in (entrypoint, module_name, *_parents(entrypoint)):
            raise
        module = importlib.import_module(module_name)
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(
            f"entrypoint {entrypoint!r}: {module.__name__} has no callable {attr!r}; pass "
            "'module' (which must define main) or 'module.function'"
        )
    return function


def _parents(dotted: str) -> list[str]:
    parts = dotted.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def entrypoint_string(entrypoint: Any) -> str:
    """The ``module`` / ``module.function`` string that remote backends run (``""`` and None:
    ``DEFAULT_ENTRYPOINT``, the replica entrypoint)."""
    if entrypoint is None or entrypoint == "":
        return DEFAULT_ENTRYPOINT
    if isinstance(entrypoint, str):
        return entrypoint
    module, name = getattr(entrypoint, "__module__", None), getattr(entrypoint, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ValueError(
            f"a remote backend runs the entrypoint by import path; {entrypoint!r} has none "
            "(defined in __main__ or a closure): pass 'module.function' instead"
        )
    return f"{module}.{name}"


def launch_spec(
    entrypoint: Any, entrypoint_args: dict[str, Any], n_replicas: int
) -> tuple[str, dict[str, Any]]:
    """``(entrypoint string, entrypoint_args)`` as a backend runs them.

    For the default entry point (``""`` or ``DEFAULT_ENTRYPOINT``) the arguments must name
    ``rendezvous_uri`` and ``trainer_module`` (``ValueError`` otherwise, before anything is
    launched) and ``world_size`` defaults to ``n_replicas``.
    """
    spec = entrypoint_string(entrypoint)
    args = dict(entrypoint_args)
    if spec == DEFAULT_ENTRYPOINT:
        missing = [k for k in ("rendezvous_uri", "trainer_module") if not args.get(k)]
        if missing:
            raise ValueError(
                f"entrypoint_args lacks {missing}: the default entry point ({DEFAULT_ENTRYPOINT}) "
                "joins the rendezvous_uri and runs trainer_module's trainer_fn"
            )
        args.setdefault("world_size", n_replicas)
    return spec, args


def scalar_env(entrypoint_args: dict[str, Any]) -> dict[str, str]:
    """Scalar entrypoint_args as upper-cased environment variables (lists/dicts skipped)."""
    env = {}
    for key, value in entrypoint_args.items():
        if isinstance(value, bool):
            env[key.upper()] = "1" if value else "0"
        elif isinstance(value, (str, int, float)):
            env[key.upper()] = str(value)
    return env


def collect_by_polling(
    executor: Any,
    handles: list[ReplicaHandle],
    timeout: float | None,
    interval_s: float,
    result: Callable[[ReplicaHandle, str], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Poll until every handle is terminal (or ``timeout``), then build one row per rank:
    ``rank`` and ``status`` first, then what ``result(handle, status)`` returns (the
    protocol's ``exit_code`` and ``error``, and the backend's own keys).

    Rows of replicas still running at the deadline keep their live status.
    """
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        statuses = {h.rank: executor.poll(h) for h in handles}
        done = all(s in TERMINAL for s in statuses.values())
        if done or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(interval_s)
    return [
        {"rank": h.rank, "status": statuses[h.rank], **result(h, statuses[h.rank])}
        for h in sorted(handles, key=lambda h: h.rank)
    ]


def launch_one_by_one(
    executor: Any,
    n_replicas: int,
    start_rank: Callable[[int], dict[str, Any]],
    failure: Callable[[int, Exception], str],
) -> list[ReplicaHandle]:
    """Start ranks ``0..n_replicas-1`` in order; ``start_rank(rank)`` launches one and returns
    its handle's metadata.

    If rank k fails, ranks ``0..k-1`` are cancelled before ``RuntimeError(failure(k, exc))``
    is raised: a partial DiLoCo run would only wait for peers that never come. The cancels
    are best effort (the launch error is the one to report, and one failed cancel must not
    leave the later ranks running).
    """
    handles: list[ReplicaHandle] = []
    for rank in range(n_replicas):
        try:
            metadata = start_rank(rank)
        except Exception as exc:
            for launched in handles:
                with contextlib.suppress(Exception):
                    executor.cancel(launched)
            raise RuntimeError(failure(rank, exc)) from exc
        handles.append(ReplicaHandle(rank, executor.backend_name, metadata))
    return handles


def import_sdk(module: str, install_hint: str) -> Any:
    """A backend's optional SDK, imported when the executor first needs it; a missing one is
    a ``RuntimeError`` whose message is ``install_hint`` (what to pip install)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(install_hint) from exc
