"""Normalise DPO pairs into chat-format records with a data-juicer recipe.

`DJNormalizer.normalize(pairs)` runs each pair's two sides through data-juicer's executor
as separate records (`{"text", "pair_index", "side"}`), so every mapper cleans both and
every filter judges both; a pair survives only if both sides do and they still differ
after cleaning (whitespace-normalised). `skip_dj=True` passes pairs through unchanged with
`metadata={"skipped": True}`. The state context (`state_messages`) is carried over as it is:
recipes are for the actions, and the context can be hundreds of kilobytes per pair.

`replay_and_normalize_trace` chains `replay_trace` -> `extract_dpo_pairs` -> `normalize`,
building the normalizer first so a missing data-juicer fails before any money is spent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_replication.traces.replaysim.dj_runner import DJ_EXTRA, dj_available, run_recipe
from composer_replication.traces.teacher_replay.pairs import extract_dpo_pairs, normalize_action
from composer_replication.traces.teacher_replay.records import (
    DEFAULT_TEACHERS,
    ChatMessage,
    DPOPair,
    TeacherCallResult,
    TeacherSpec,
    TraceState,
)

__all__ = [
    "DEFAULT_RECIPE",
    "DJNormalizer",
    "NormalizationStats",
    "NormalizedDPOPair",
    "replay_and_normalize_trace",
    "replay_and_normalize_trace_sync",
]

DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "replaysim" / "default.yaml"


@dataclass(frozen=True)
class NormalizedDPOPair:
    """A DPO pair in chat format: each side is a list with one assistant message."""

    state_id: str
    state_messages: list[ChatMessage]
    chosen_messages: list[ChatMessage]
    rejected_messages: list[ChatMessage]
    n_teachers_agreeing: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (the JSONL row the CLI writes)."""
        return {
            "state_id": self.state_id,
            "state_messages": self.state_messages,
            "chosen_messages": self.chosen_messages,
            "rejected_messages": self.rejected_messages,
            "n_teachers_agreeing": self.n_teachers_agreeing,
            "metadata": self.metadata,
        }


@dataclass(frozen=True)
class NormalizationStats:
    """What the last `normalize` call kept and dropped."""

    n_pairs_in: int
    n_pairs_out: int
    n_dropped_by_recipe: int
    n_dropped_identical: int


def _assistant(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="assistant", content=text)]


class DJNormalizer:
    """Runs pairs through a data-juicer recipe (see the module docstring).

    Class attribute `DEFAULT_RECIPE`: the recipe used when none is given (the module's
    `DEFAULT_RECIPE`).

    Args:
        recipe_path: a data-juicer YAML recipe; default `DEFAULT_RECIPE`.
        skip_dj: pass pairs through without data-juicer.

    Raises:
        FileNotFoundError: the recipe does not exist (checked unless `skip_dj` with the
            default recipe).
        RuntimeError: data-juicer is not installed and `skip_dj` is False.
    """

    DEFAULT_RECIPE: Path = DEFAULT_RECIPE

    def __init__(self, recipe_path: str | Path | None = None, *, skip_dj: bool = False) -> None:
        self.recipe_path = Path(recipe_path) if recipe_path is not None else self.DEFAULT_RECIPE
        self.skip_dj = skip_dj
        self.last_stats: NormalizationStats | None = None
        if (recipe_path is not None or not skip_dj) and not self.recipe_path.is_file():
            raise FileNotFoundError(
                f"data-juicer recipe {str(self.recipe_path)!r} does not exist; pass an existing "
                f"YAML recipe or None for the default ({self.DEFAULT_RECIPE})"
            )
        if not skip_dj and not dj_available():
            raise RuntimeError(
                "data-juicer is not installed: install the extra with "
                f"`pip install 'composer-replication[{DJ_EXTRA}]'`, or pass skip_dj=True "
                "to pass pairs through unnormalised"
            )

    def normalize(self, pairs: Iterable[DPOPair]) -> list[NormalizedDPOPair]:
        """Normalised pairs, in input order; recipe filters may drop some."""
        pairs = list(pairs)
        if self.skip_dj:
            out = [self._pair(p, p["chosen"], p["rejected"], {"skipped": True}) for p in pairs]
            self.last_stats = NormalizationStats(len(pairs), len(out), 0, 0)
            return out
        records = [
            {"text": p[side], "pair_index": i, "side": side}
            for i, p in enumerate(pairs)
            for side in ("chosen", "rejected")
        ]
        cleaned: dict[tuple[int, str], str] = {}
        for row in run_recipe(self.recipe_path, records):
            cleaned[(int(row["pair_index"]), str(row["side"]))] = str(row["text"])
        out, n_identical = [], 0
        for i, p in enumerate(pairs):
            chosen, rejected = cleaned.get((i, "chosen")), cleaned.get((i, "rejected"))
            if chosen is None or rejected is None:
                continue
            if normalize_action(chosen) == normalize_action(rejected):
                n_identical += 1
                continue
            metadata = {
                "skipped": False,
                "recipe": str(self.recipe_path),
                "chosen_changed": chosen != p["chosen"],
                "rejected_changed": rejected != p["rejected"],
            }
            out.append(self._pair(p, chosen, rejected, metadata))
        n_by_recipe = len(pairs) - len(out) - n_identical
        self.last_stats = NormalizationStats(len(pairs), len(out), n_by_recipe, n_identical)
        return out

    @staticmethod
    def _pair(
        pair: DPOPair, chosen: str, rejected: str, metadata: dict[str, Any]
    ) -> NormalizedDPOPair:
        return NormalizedDPOPair(
            state_id=pair["state_id"],
            state_messages=list(pair["state_messages"]),
            chosen_messages=_assistant(chosen),
            rejected_messages=_assistant(rejected),
            n_teachers_agreeing=pair["n_teachers_agreeing"],
            metadata=metadata,
        )


async def replay_and_normalize_trace(
    *,
    states: Iterable[TraceState],
    teachers: Sequence[TeacherSpec] | None = None,
    agreement_threshold: int = 2,
    max_total_usd: float = 5.0,
    normalizer: DJNormalizer | None = None,
    **replay_kwargs: Any,
) -> tuple[list[TeacherCallResult], list[NormalizedDPOPair]]:
    """Replay `states` through `teachers`, extract pairs, normalise them.

    `replay_kwargs` go to `replay_trace` (`api_key`, `concurrency`, `cache_dir`, ...).
    `normalizer=None` builds `DJNormalizer()` (needs data-juicer) before any call is made.

    Returns:
        (raw rows from `replay_trace`, normalised pairs).
    """
    from composer_replication.traces.teacher_replay.replay import replay_trace

    normalizer = normalizer if normalizer is not None else DJNormalizer()
    states = list(states)
    rows = await replay_trace(
        states,
        DEFAULT_TEACHERS if teachers is None else teachers,
        max_total_usd,
        **replay_kwargs,
    )
    pairs = extract_dpo_pairs(states, rows, agreement_threshold)
    # data-juicer is synchronous and slow: keep the event loop free while it runs.
    normalized = await asyncio.to_thread(normalizer.normalize, pairs)
    return rows, normalized


def replay_and_normalize_trace_sync(
    **kwargs: Any,
) -> tuple[list[TeacherCallResult], list[NormalizedDPOPair]]:
    """`replay_and_normalize_trace` for synchronous code (runs its own event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(replay_and_normalize_trace(**kwargs))
    raise RuntimeError(
        "replay_and_normalize_trace_sync was called inside a running event loop; "
        "await replay_and_normalize_trace(...) instead"
    )
