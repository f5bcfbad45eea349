"""A run's identity: the settings a checkpoint may only be resumed with.

Resuming continues an objective: the model and its trainable parameters, the environments
in their order with each one's algorithm and tasks, the loss, and the held-out split. A
config that changes any of them does not continue the checkpoint, it trains something else
on top of it (and a changed split could train on tasks the run held out), so ``--resume``
refuses it in one line naming the first difference (:func:`identity_difference`).

Everything else may change on resume: ``steps``, ``max_wall_seconds``, the evaluation
(``[eval]``), logging and trackers, ``save_rollouts``, checkpointing, the optimizer and
its schedule, ``micro_batch_tokens``, the inference engine and role placement, ``seed``.

Pure functions over a config's JSON form (``RunConfig.model_dump(mode="json")``, the
``config.json`` a run writes), so a recorded run and a new config compare alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["IDENTITY_KEYS", "identity_difference", "run_identity"]

#: the top-level settings that are part of a run's identity (``envs`` in part: below)
IDENTITY_KEYS = ("model", "envs", "loss", "heldout_fraction", "heldout_salt")
# of the model: what decides the trainable parameters and what they start from
_MODEL_KEYS = ("source", "lora")
# of an environment's options: where its tasks come from
_TASK_OPTIONS = ("task_file", "repo", "kind", "bug_kinds", "tasks")


def run_identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """The identity of a run config given in its JSON form (a setting the form does not
    have, as in an older run's record, is left out)."""
    model = config.get("model") or {}
    envs = []
    for env in config.get("envs") or []:
        algorithm = env.get("algorithm") or {}
        options = env.get("options") or {}
        envs.append(
            {
                "name": env.get("name"),
                "algorithm": algorithm.get("advantage"),
                "tasks": {k: options[k] for k in _TASK_OPTIONS if k in options},
            }
        )
    identity = {
        "model": {k: model[k] for k in _MODEL_KEYS if k in model},
        "envs": envs,
        "loss": config.get("loss"),
        "heldout_fraction": config.get("heldout_fraction"),
        "heldout_salt": config.get("heldout_salt"),
    }
    return {k: v for k, v in identity.items() if k in config}


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key in sorted(value):
            yield from _leaves(value[key], f"{path}.{key}" if path else str(key))
    elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        yield f"number of {path}", len(value)
        for k, item in enumerate(value):
            yield from _leaves(item, f"{path}.{k}")
    else:
        yield path, value


def identity_difference(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """The first setting two identities differ in, as ``"name: A in the checkpoint's run,
    B in this config"``; None when they are the same. Only what ``recorded`` has is
    compared (a record from before a setting existed), and how many entries a list has."""
    old, new = dict(_leaves(recorded, "")), dict(_leaves(current, ""))

    def order(key: str) -> tuple[int, bool, bool, int, str]:
        # the model first, then the environments (how many, which, their algorithms'
        # types before their settings), the loss, the split
        top = key.removeprefix("number of ").split(".", 1)[0]
        rank = IDENTITY_KEYS.index(top) if top in IDENTITY_KEYS else len(IDENTITY_KEYS)
        counted = key.startswith("number of ")
        return rank, not counted, not key.endswith((".name", ".type")), key.count("."), key

    for key in sorted(set(old) | set(new), key=order):
        if key not in old and not key.startswith("number of "):
            continue
        if old.get(key) != new.get(key):
            return (
                f"{key}: {old.get(key)!r} in the checkpoint's run, {new.get(key)!r} in this config"
            )
    return None
