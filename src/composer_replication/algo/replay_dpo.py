"""``replay_dpo``: DPO on preference pairs from teacher-consensus trace replay.

Composer channel 3. Pairs come from ``teacher_replay.extract_dpo_pairs`` (``DPOPair``:
``state_messages`` + ``chosen`` / ``rejected`` assistant texts) or from replaysim
(``NormalizedDPOPair``: ``state_messages`` + ``chosen_messages`` / ``rejected_messages``),
as objects, dicts or a JSONL file. Each side is tokenised with the chat template as the
state followed by the response messages; the response mask covers the tokens after the
rendered state (the assistant turn, end-of-turn token included).

Each group (``finalize_group``) gets ``pairs_per_group`` pair-only samples
(``input_ids=[]``), drawn from the pool without replacement until it is exhausted, then
reshuffled; the rollouts themselves make no samples. ``score`` fills the frozen reference's
summed response log-probs on each pair once (cached on the pair); without a
``reference_scorer`` (the ``dpo_reference`` pool) it leaves them to the trainer's reference
model
(:func:`composer_replication.ops.pairs.fill_reference_logps`). Without ``pairs_path`` the
pairs shipped with the package are used.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer_replication.algo.base import Algorithm, AlgorithmResources, FrozenPool
from composer_replication.algo.context import render_prompt
from composer_replication.algo.scoring import PrefillScorer
from composer_replication.config.advantage import ReplayDPOAdvantage
from composer_replication.ops.pairs import missing_reference, set_reference_logps
from composer_replication.samples.rollouts import Rollout
from composer_replication.samples.wire import DPOPairTokens, TrainingSample


def _get(record: Any, key: str) -> Any:
    return record.get(key) if isinstance(record, dict) else getattr(record, key, None)


def _response_messages(record: Any, side: str) -> list[dict[str, Any]]:
    messages = _get(record, f"{side}_messages")
    if messages:
        return [dict(m) for m in messages]
    text = _get(record, side)
    if text is None:
        raise ValueError(
            f"preference pair {_get(record, 'state_id') or ''!r} has neither {side!r} nor "
            f"{side + '_messages'!r}"
        )
    return [{"role": "assistant", "content": str(text)}]


def _render_side(tokenizer: Any, state: list[dict], prompt: list[int], response: list[dict]):
    full = tokenizer.apply_chat_template([*state, *response], tokenize=True)
    full = [int(t) for t in (full["input_ids"] if hasattr(full, "keys") else full)]
    if full[: len(prompt)] == prompt and len(full) > len(prompt):
        return full, [0] * len(prompt) + [1] * (len(full) - len(prompt))
    # Templates that render an assistant turn differently from the generation prompt:
    # the response text's own tokens + eos after the prompt.
    text = "\n".join(str(m.get("content") or "") for m in response)
    ids = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return [*prompt, *ids], [0] * len(prompt) + [1] * len(ids)


def tokenize_pair(record: Any, tokenizer: Any, *, weight: float = 1.0) -> DPOPairTokens:
    """A ``DPOPair`` / ``NormalizedDPOPair`` (object or dict) as ``DPOPairTokens``."""
    state = [dict(m) for m in (_get(record, "state_messages") or [])]
    if not state:
        raise ValueError(f"preference pair {_get(record, 'state_id')!r} has no state_messages")
    prompt = render_prompt(tokenizer, state)
    chosen_ids, chosen_mask = _render_side(
        tokenizer, state, prompt, _response_messages(record, "chosen")
    )
    rejected_ids, rejected_mask = _render_side(
        tokenizer, state, prompt, _response_messages(record, "rejected")
    )
    return DPOPairTokens(chosen_ids, chosen_mask, rejected_ids, rejected_mask, weight=weight)


#: The preference pairs shipped with the package (built from the bundled traces).
DEFAULT_PAIRS_PATH = Path(__file__).resolve().parent.parent / "envs" / "data" / "replay_pairs.jsonl"


def load_pair_records(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Records of a JSONL pairs file (blank lines skipped); None: the shipped pairs."""
    path = Path(path) if path else DEFAULT_PAIRS_PATH
    if not path.is_file():
        raise FileNotFoundError(f"DPO pair file {path} does not exist")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not JSON ({err})") from err
    return rows


def build_pair_pool(
    pairs: Sequence[Any] | None, path: str | None, tokenizer: Any, *, weight: float
) -> list[DPOPairTokens]:
    """Tokenised pairs (``pairs`` if given, else the file at ``path``, else the shipped
    pairs), each with ``weight``."""
    records = list(pairs) if pairs is not None else load_pair_records(path)
    out = []
    for record in records:
        if isinstance(record, DPOPairTokens):
            out.append(dataclasses.replace(record, weight=weight))
            continue
        if tokenizer is None:
            raise ValueError("tokenising preference pairs needs tokenizer=")
        out.append(tokenize_pair(record, tokenizer, weight=weight))
    return out


def _as_state(value: Any) -> tuple:
    """A ``random.Random`` state back from its JSON-ish form (lists for tuples)."""
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


class PairPool:
    """Draws pairs without replacement; reshuffles (with ``rng``) when exhausted."""

    def __init__(self, pairs: Sequence[DPOPairTokens], rng: random.Random) -> None:
        self.pairs = list(pairs)
        self.rng = rng
        self._order: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        """The random state and the rest of the current pass (for an exact resume)."""
        return {"rng": self.rng.getstate(), "order": list(self._order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(_as_state(state["rng"]))
        self._order = [int(i) for i in state["order"]]

    def draw(self, k: int) -> list[DPOPairTokens]:
        out: list[DPOPairTokens] = []
        while self.pairs and len(out) < k:
            if not self._order:
                self._order = list(range(len(self.pairs)))
                self.rng.shuffle(self._order)
            out.append(self.pairs[self._order.pop()])
        return out


def pair_sample(pair: DPOPairTokens, source: str) -> TrainingSample:
    """A pair-only sample (no token streams)."""
    return TrainingSample(
        input_ids=[], loss_mask=[], inference_logprobs=[], dpo=pair, source=source
    )


async def fill_pair_reference_logps(pairs: Sequence[DPOPairTokens], scorer: PrefillScorer) -> None:
    """Summed reference log-probs of each side's masked tokens, cached on the pairs.

    Equals ``ops.pairs.sequence_logps`` under the scorer's model (token 0 never counts).
    """
    todo = missing_reference(pairs)
    if not todo:
        return
    seqs, masks = [], []
    for pair in todo:
        seqs += [pair.chosen_ids, pair.rejected_ids]
        masks += [pair.chosen_mask, pair.rejected_mask]
    starts = [max(1, mask.index(1)) for mask in masks]
    scored = await scorer.score(seqs, starts)
    sums = [
        sum(v for v, m in zip(values, mask[start:]) if m)
        for values, mask, start in zip(scored, masks, starts)
    ]
    set_reference_logps(todo, sums[0::2], sums[1::2])


class PairDrawing(Algorithm):
    """What an algorithm that draws preference pairs shares: the pool (its draw order is
    the algorithm's resumable state) and the pairs' frozen reference (``dpo_reference``,
    optional: without it the trainer's reference model fills the log-probs)."""

    frozen_pools = (FrozenPool("dpo_reference", given_as="reference_scorer"),)
    pool: PairPool

    def _draw_from(
        self,
        pairs: Sequence[DPOPairTokens],
        rng: random.Random | None,
        reference_scorer: PrefillScorer | None,
    ) -> None:
        self.pool = PairPool(pairs, rng or random.Random(0))
        if reference_scorer is not None:
            self.connect_frozen_pool("dpo_reference", reference_scorer)

    @property
    def reference_scorer(self) -> PrefillScorer | None:
        """The pairs' frozen reference, None when the trainer's reference model scores."""
        return self.connected_pools.get("dpo_reference")

    def state_dict(self) -> dict[str, Any]:
        return {"pool": self.pool.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("pool"):
            self.pool.load_state_dict(state["pool"])

    async def score_pairs(self, samples: list[TrainingSample]) -> None:
        """DPO reference log-probs of the samples' pairs (left to the trainer without a
        scorer)."""
        if self.reference_scorer is None:
            return
        pairs = [s.dpo for s in samples if s.dpo is not None]
        await fill_pair_reference_logps(pairs, self.reference_scorer)


class ReplayDPOAlgorithm(PairDrawing):
    """dpo on replayed preference pairs; rollouts of the group carry no signal here."""

    config_class = ReplayDPOAdvantage

    def __init__(
        self,
        config: Any,
        pairs: Sequence[DPOPairTokens],
        *,
        reference_scorer: PrefillScorer | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(config)
        self._draw_from(pairs, rng, reference_scorer)

    @classmethod
    def from_resources(cls, config: Any, resources: AlgorithmResources) -> ReplayDPOAlgorithm:
        cfg = config.advantage
        pairs = build_pair_pool(
            resources.pairs, cfg.pairs_path, resources.tokenizer, weight=cfg.beta_replay
        )
        return cls(config, pairs, rng=resources.rng)

    def check_group(self, group: list[Rollout]) -> None:
        """Any group: its rollouts are not read."""

    def build_samples(self, rollout: Rollout) -> list[TrainingSample]:
        """None: a rollout carries no dpo signal."""
        return []

    def finalize_group(
        self, group: list[Rollout], samples: list[TrainingSample]
    ) -> list[TrainingSample]:
        """``pairs_per_group`` pair-only samples from the pool."""
        k = self.advantage_config.pairs_per_group
        return [pair_sample(pair, self.name) for pair in self.pool.draw(k)]

    async def score_samples(self, samples: list[TrainingSample]) -> None:
        """Reference log-probs for DPO pairs (SimPO is reference-free: nothing to do)."""
        if self.advantage_config.dpo_variant != "simpo":
            await self.score_pairs(samples)
