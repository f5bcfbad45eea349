"""The one table of module paths that are not where their code lives: the same module objects.

``import composer_replication.ingestion.claude_code`` (a path of the seed API) finds
:mod:`composer_replication.traces.ingestion.claude_code` and registers that very module
object under the seed's name too, lazily and without a second copy: classes, functions and
module state are identical under both names (``isinstance`` and ``monkeypatch`` work
across them).

- :data:`SEED_PATHS`: the seed API's module paths whose code lives in the layout's
  packages. They are the public contract and stay, silently.
- :data:`MOVED`: earlier paths of modules that moved. The first import of each warns
  (``DeprecationWarning``) with the path to use instead; they are removed in
  :data:`REMOVED_IN`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

#: the release that drops the old paths (the one after ``composer_replication.__version__``)
REMOVED_IN = "0.2.0"

#: seed API path -> where the module lives (submodules follow their package); permanent.
SEED_PATHS: dict[str, str] = {
    "composer_replication.ingestion": "composer_replication.traces.ingestion",
    "composer_replication.teacher_replay": "composer_replication.traces.teacher_replay",
    "composer_replication.replaysim": "composer_replication.traces.replaysim",
    "composer_replication.datagen.sandbox": "composer_replication.sandbox",
    "composer_replication.datagen.docker_sandbox": "composer_replication.sandbox.docker",
    "composer_replication.trainer.components": "composer_replication.ops.token_losses",
    "composer_replication.distillation.dpo": "composer_replication.ops.dpo",
    "composer_replication.distillation.simpo": "composer_replication.ops.simpo",
    "composer_replication.distillation.taid": "composer_replication.ops.taid",
    "composer_replication.distillation.entropy_aware_opd": "composer_replication.ops.entropy_aware_opd",
}

#: earlier module path -> current path (submodules follow their package); deprecated.
MOVED: dict[str, str] = {
    "composer_replication.trace_cli": "composer_replication.traces.cli",
    "composer_replication.trainer.ranks": "composer_replication.distributed.ranks",
    "composer_replication.datagen.fd_tasks": "composer_replication.envs.fd_tasks",
    "composer_replication.datagen.hack_monitor": "composer_replication.safety.hack_monitor",
    "composer_replication.datagen.scrub": "composer_replication.sandbox.scrub",
    "composer_replication.models": "composer_replication.model.loading",
    "composer_replication.model_parts": "composer_replication.model.parts",
    "composer_replication.shared_prefix": "composer_replication.model.shared_prefix",
    "composer_replication.packed_attention": "composer_replication.model.packed_attention",
    "composer_replication.devices": "composer_replication.model.devices",
    "composer_replication.memory_estimate": "composer_replication.model.memory_estimate",
    "composer_replication.cpu_allocator": "composer_replication.model.cpu_allocator",
    "composer_replication.wire": "composer_replication.samples.wire",
    "composer_replication.forward_tokens": "composer_replication.samples.forward_tokens",
    "composer_replication.padding": "composer_replication.samples.padding",
    "composer_replication.padded_batch": "composer_replication.ops.padded",
    "composer_replication.trainer.composer_trainer": "composer_replication.backends.trl.trainer",
    "composer_replication.trainer.trl_backend": "composer_replication.backends.trl.run",
    "composer_replication.trainer.po_presets": "composer_replication.backends.trl.po_presets",
    "composer_replication.datagen.curriculum": "composer_replication.envs.curriculum",
    "composer_replication.rollout.generate": "composer_replication.inference.decoding.generate",
    "composer_replication.rollout.decode": "composer_replication.inference.decoding.decode",
    "composer_replication.rollout.static_decode": "composer_replication.inference.decoding.static_decode",
    "composer_replication.rollout.llama_decoder": "composer_replication.inference.decoding.llama_decoder",
    "composer_replication.rollout.kv_cache": "composer_replication.inference.decoding.kv_cache",
    "composer_replication.rollout.decode_buckets": "composer_replication.inference.decoding.decode_buckets",
    "composer_replication.rollout.packed_linear": "composer_replication.inference.decoding.packed_linear",
    "composer_replication.rollout.uploads": "composer_replication.inference.decoding.uploads",
    "composer_replication.rollout.decode_memory": "composer_replication.inference.decoding.decode_memory",
    "composer_replication.rollout.padding": "composer_replication.inference.decoding.padding",
    "composer_replication.trainer.checkpoint": "composer_replication.training.checkpoint",
    "composer_replication.trainer.learner": "composer_replication.training.learner",
    "composer_replication.trainer.lifecycle": "composer_replication.training.lifecycle",
    "composer_replication.trainer.loop": "composer_replication.training.loop",
    "composer_replication.trainer.loss_schedule": "composer_replication.training.loss_schedule",
    "composer_replication.trainer.replica": "composer_replication.training.replica",
    "composer_replication.trainer.rollout_queue": "composer_replication.training.rollout_queue",
    "composer_replication.trainer.run_lock": "composer_replication.training.run_lock",
    "composer_replication.trainer.run_record": "composer_replication.training.run_record",
    "composer_replication.trainer.runtime": "composer_replication.training.runtime",
    "composer_replication.trainer.setup": "composer_replication.training.setup",
    "composer_replication.trainer.step": "composer_replication.training.step",
    "composer_replication.trainer.teachers": "composer_replication.training.teachers",
    "composer_replication.trainer.metrics": "composer_replication.common.metrics",
    "composer_replication.trainer.rollout_log": "composer_replication.samples.rollout_log",
    "composer_replication.atomic_io": "composer_replication.common.atomic_io",
    "composer_replication.pids": "composer_replication.common.pids",
    "composer_replication.project_cache": "composer_replication.common.project_cache",
    "composer_replication.outputs": "composer_replication.common.outputs",
    "composer_replication.callables": "composer_replication.common.callables",
    "composer_replication.errors": "composer_replication.common.errors",
    "composer_replication.compat": "composer_replication.common.compat",
    "composer_replication.progress": "composer_replication.common.progress",
    "composer_replication.rollout.types": "composer_replication.samples.rollouts",
    "composer_replication.evaluate": "composer_replication.evals.heldout",
    "composer_replication.report": "composer_replication.training.report",
}


# old paths that have warned in this process
_warned: set[str] = set()


def current_name(name: str) -> str | None:
    """The current path of module ``name`` if it lies under a seed or moved path, else None."""
    for old, new in (*SEED_PATHS.items(), *MOVED.items()):
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


def deprecated(name: str) -> bool:
    """Whether ``name`` lies under a moved path (not a seed API path)."""
    return any(name == old or name.startswith(old + ".") for old in MOVED)


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module path to the module at its current path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if current_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        # The module itself, not a copy: its attributes (__name__, __spec__) stay the
        # current ones, and the import system stores it under the old name as well.
        new = current_name(spec.name) or spec.name
        # once per path (sys.modules answers later imports); seed API paths never warn
        if deprecated(spec.name) and spec.name not in _warned:
            _warned.add(spec.name)
            warnings.warn(
                f"{spec.name} is deprecated and will be removed in composer-replication "
                f"{REMOVED_IN}; import {new} instead",
                DeprecationWarning,
                stacklevel=2,  # the import statement (the warnings module skips importlib)
            )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module executed when it was imported under its own name."""


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once), ahead of the file-system finder."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
