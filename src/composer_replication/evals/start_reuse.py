"""The start evaluation of an initial policy measured before, reused instead of run again.

A run's first held-out evaluation measures the policy it starts from. Its sampling is seeded
by ``eval.seed`` and LoRA adapters start as a no-op, so runs that start from the same
weights, with the same held-out tasks, evaluation settings, code and libraries get the same
numbers, whatever their seed, steps or optimizer: the three seeds of a benchmark, or a user
tuning the learning rate, evaluate the same policy three times. With ``eval.reuse_start``
the first such run keeps its result in the project's cache (``evaluations/<key>.json``,
and the evaluated rollouts beside it when the run saved them) and the others read it back.

The key is a digest of everything the evaluation's numbers depend on:

- the weights the sampler computes with (LoRA folded in: adapters that start at zero add
  nothing), and the tokenizer's vocabulary and chat template;
- each environment's held-out tasks as the environment itself digests them
  (``evaluation_digest(task_ids)``: the task records, what grading reads, such as a
  repository task's files, and the function that builds its sandboxes); an environment
  without that method, or whose sandboxes come from a closure (:func:`~composer_replication.common.digests.grader_name`), is
  never reused;
- the run configuration without the fields only training reads (:data:`TRAINING_ONLY`);
- the code: this package's files, the versions of Python, torch and transformers, torch's
  thread count (it sets the summation order of the CPU kernels), and the sampling device.

Anything missing or unreadable is a miss: the evaluation then runs as usual. Only a
single-process run reuses (ranks on several machines could disagree about a hit).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from composer_replication.common.atomic_io import write_text_atomic
from composer_replication.common.project_cache import cache_dir

__all__ = [
    "TRAINING_ONLY",
    "StartEvaluation",
    "load_start_evaluation",
    "start_evaluation_key",
    "store_start_evaluation",
    "weights_digest",
]

log = logging.getLogger(__name__)

#: Top-level run settings the start evaluation does not read (``eval.every``, ``eval.at_start``
#: and ``eval.reuse_start`` are left out too).
TRAINING_ONLY = (
    "seed",
    "steps",
    "max_wall_seconds",
    "output_dir",
    "optim",
    "loss",
    "filters",
    "jsd_teacher",
    "ema_decay",
    "micro_batch_tokens",
    "malloc_mmap_threshold",
    "malloc_trim_every_s",
    "pairs_file",
    "guard",
    "checkpoint",
    "trackers",
    "save_rollouts",
)
_FORMAT = 1


@dataclass(frozen=True)
class StartEvaluation:
    """What a start evaluation reported: sampled pass@1, the other held-out scores (their
    metric names), the hack-flagged fraction of its attempts; ``rollouts``: the evaluated
    rollouts file kept with it (None: the run that measured it saved none)."""

    pass_at_1: float
    scores: dict[str, float]
    hack_fraction: float
    created: str
    rollouts: Path | None = None


def evaluations_dir() -> Path:
    return cache_dir() / "evaluations"


def _update_tensor(h: Any, name: str, tensor: Any) -> None:
    import torch

    t = tensor.detach()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
    t = t.to("cpu").contiguous()
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())


def weights_digest(model: Any) -> str:
    """Digest of the weights ``model`` samples with: parameters and buffers with its LoRA
    adapters folded in (the adapters' own matrices are left out: what they add is in the
    folded weights, so adapters initialised to a no-op digest like none)."""
    import torch

    from composer_replication.model.parts import lora_merged

    h = hashlib.blake2b(digest_size=20)
    with torch.no_grad(), lora_merged(model):
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            if "lora_" not in name:
                _update_tensor(h, name, tensor)
    return h.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    special = getattr(tokenizer, "all_special_tokens", [])
    template = getattr(tokenizer, "chat_template", None)
    text = json.dumps([vocab, list(special), template], default=str)
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


@functools.lru_cache(maxsize=1)
def _package_digest() -> str:
    import composer_replication

    root = Path(composer_replication.__file__).parent
    h = hashlib.blake2b(digest_size=20)
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _runtime() -> dict[str, Any]:
    import torch
    import transformers

    import composer_replication

    return {
        "package": composer_replication.__version__,
        "files": _package_digest(),
        "python": sys.version,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }


def _evaluation_settings(config: Any) -> dict[str, Any]:
    settings = config.model_dump(mode="json")
    for name in TRAINING_ONLY:
        settings.pop(name, None)
    for name in ("every", "at_start", "reuse_start"):
        settings["eval"].pop(name, None)
    return settings


def start_evaluation_key(
    config: Any, policy: Any, tokenizer: Any, tasks: Sequence[Any]
) -> str | None:
    """The digest naming this start evaluation (see the module docstring), or None when it
    cannot be named (an environment without ``evaluation_digest``, or one that returns
    None)."""
    environments = []
    for item in tasks:
        digest_of = getattr(item.env, "evaluation_digest", None)
        digest = None if digest_of is None else digest_of(list(item.task_ids))
        if digest is None:
            return None
        environments.append(
            {
                "env": f"{type(item.env).__module__}.{type(item.env).__qualname__}",
                "task_ids": list(item.task_ids),
                "max_new_tokens": item.max_new_tokens,
                "tasks": digest,
            }
        )
    device = next(iter(policy.parameters())).device
    facts = {
        "format": _FORMAT,
        "weights": weights_digest(policy),
        "tokenizer": tokenizer_digest(tokenizer),
        "device": device.type,
        "environments": environments,
        "settings": _evaluation_settings(config),
        "runtime": _runtime(),
    }
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


def load_start_evaluation(key: str) -> StartEvaluation | None:
    """The kept evaluation named ``key`` (None: none, or unreadable: then it is measured
    again and kept anew)."""
    path = evaluations_dir() / f"{key}.json"
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        rollouts = record.get("rollouts")
        kept = None if rollouts is None else path.with_name(rollouts)
        if kept is not None and not kept.is_file():
            raise FileNotFoundError(kept)
        return StartEvaluation(
            pass_at_1=float(record["pass@1"]),
            scores={str(k): float(v) for k, v in record["scores"].items()},
            hack_fraction=float(record["hack_fraction"]),
            created=str(record["created"]),
            rollouts=kept,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning(
            "the kept start evaluation %s is unreadable (%s); measuring it again", path, exc
        )
        return None


def store_start_evaluation(
    key: str,
    pass_at_1: float,
    scores: dict[str, float],
    hack_fraction: float,
    rollouts: Path | None,
) -> Path | None:
    """Keep a measured start evaluation under ``key`` (and a copy of its rollouts file);
    the record's path, or None when the cache cannot be written (logged; the run goes on)."""
    folder = evaluations_dir()
    path = folder / f"{key}.json"
    record = {
        "pass@1": pass_at_1,
        "scores": scores,
        "hack_fraction": hack_fraction,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "rollouts": None,
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if rollouts is not None and rollouts.is_file():
            kept = path.with_name(f"{key}.rollouts.jsonl")
            write_text_atomic(kept, rollouts.read_text())
            record["rollouts"] = kept.name
        write_text_atomic(path, json.dumps(record, indent=2, sort_keys=True))
    except OSError as exc:
        log.warning("could not keep the start evaluation in %s (%s)", folder, exc)
        return None
    return path
