"""The wire between algorithms and the trainer: training samples and packed micro-batches.

Every training signal reaches the trainer as per-token weight streams on the loss
components (``rl``, ``ce``, ``ref_kl``, ``jsd``, and any registered one:
:mod:`composer_replication.config.components`) plus optional preference pairs (``dpo``). The
packer and the counts loop over the declared components. The trainer never learns which
algorithm made a sample; samples of different algorithms pack freely into one micro-batch.

Alignment invariant: every per-token list of a sample has exactly ``len(input_ids)``
entries, and after packing every (B, T) tensor of a micro-batch has the shape of its
``input_ids``. A misaligned stream fails loudly at pack time, never trains silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from composer_replication.config.components import LossComponent, loss_components
from composer_replication.safety.holdout import DEFAULT_SPLIT, HeldoutSplit
from composer_replication.samples.forward_tokens import ForwardLoad
from composer_replication.samples.padding import pad_lists, pad_rows

if TYPE_CHECKING:
    from torch import Tensor

# Per-token float streams of a sample; filler outside a stream is 0.0.
TOKEN_STREAMS = (
    "inference_logprobs",
    "advantages",
    "rl_weights",
    "ce_weights",
    "ref_kl_weights",
    "jsd_weights",
    "ref_logprobs",
)


@dataclass
class DPOPairTokens:
    """A tokenised preference pair: chosen and rejected sequences with response masks.

    ``ref_chosen_logp`` / ``ref_rejected_logp`` are the summed response log-probs under
    the frozen reference, filled in once (by the algorithm's ``score`` or the trainer) and
    cached here. ``weight`` is the pair's coefficient in the ``dpo`` component.
    """

    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    weight: float = 1.0
    ref_chosen_logp: float | None = None
    ref_rejected_logp: float | None = None

    def __post_init__(self) -> None:
        for side in ("chosen", "rejected"):
            ids, mask = getattr(self, f"{side}_ids"), getattr(self, f"{side}_mask")
            if len(ids) != len(mask):
                raise ValueError(
                    f"DPO pair: {side}_mask has {len(mask)} entries for {len(ids)} tokens"
                )
            if not any(mask):
                raise ValueError(f"DPO pair: the {side} response mask selects no token")


@dataclass
class TrainingSample:
    """One sequence (and/or one preference pair) with its per-token training signal.

    Attributes:
        input_ids: prompt + completion token ids (may be empty for a pair-only sample).
        loss_mask: 1 on trainable tokens (the ones the policy sampled).
        inference_logprobs: sampler log-probs per token (0.0 where not sampled).
        advantages: per-token advantages; None = no rl credit, legal only when the sample
            has no live rl token (set ``rl_weights`` to zeros).
        rl_weights: weight of the ``rl`` component per token; None = 1 on every trainable
            token.
        ce_weights, ref_kl_weights, jsd_weights: weights of those components per token;
            None = the component is off for this sample.
        ref_logprobs: reference log-probs per token (needed where ``ref_kl_weights`` != 0).
        teacher_input_ids: the teacher context for ``jsd`` (hint or demonstration + the same
            completion).
        teacher_index: per token of ``input_ids``, the index in ``teacher_input_ids`` of
            the same token (-1 where there is none); needed where ``jsd_weights`` != 0.
        dpo: an optional preference pair.
        task_id, source: where the sample came from (metrics, and the held-out check of
            ``pack_samples``; never used for branching).
        weights: the weight streams of registered loss components, by stream name (the
            built-in components' streams are the fields above).
    """

    input_ids: list[int]
    loss_mask: list[int]
    inference_logprobs: list[float]
    advantages: list[float] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None
    jsd_weights: list[float] | None = None
    ref_logprobs: list[float] | None = None
    teacher_input_ids: list[int] | None = None
    teacher_index: list[int] | None = None
    dpo: DPOPairTokens | None = None
    task_id: str = ""
    source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, list[float]] = field(default_factory=dict)

    def stream(self, name: str) -> list[float] | None:
        """The per-token stream ``name``: a field of the sample, or a registered component's
        stream in :attr:`weights` (None when absent)."""
        if name in _SAMPLE_FIELDS:
            return getattr(self, name)
        return self.weights.get(name)

    def check_alignment(self) -> None:
        """Raise ``ValueError`` naming the stream whose length differs from input_ids."""
        n = len(self.input_ids)
        registered = {c.stream for c in loss_components()}
        for name in self.weights:
            if name in _SAMPLE_FIELDS or name not in registered:
                raise ValueError(
                    f"sample {self.task_id or '<unnamed>'} ({self.source or 'unknown source'}): "
                    f"weights[{name!r}] is the stream of no registered loss component; "
                    "register the component (config.components.register_component) first"
                )
        for name in ("loss_mask", *TOKEN_STREAMS, "teacher_index", *self.weights):
            value = self.stream(name)
            if value is not None and len(value) != n:
                raise ValueError(
                    f"sample {self.task_id or '<unnamed>'} ({self.source or 'unknown source'}): "
                    f"{name} has {len(value)} entries but input_ids has {n}; every per-token "
                    "stream must be aligned with input_ids"
                )
        if self.jsd_weights is not None and any(self.jsd_weights):
            if self.teacher_input_ids is None or self.teacher_index is None:
                raise ValueError(
                    f"sample {self.task_id}: jsd_weights are set but teacher_input_ids / "
                    "teacher_index are missing"
                )
            n_t = len(self.teacher_input_ids)
            for pos, (w, t_pos) in enumerate(zip(self.jsd_weights, self.teacher_index)):
                if w == 0:
                    continue
                if not 0 < t_pos < n_t or pos == 0:
                    raise ValueError(
                        f"sample {self.task_id}: token {pos} has a jsd weight but teacher "
                        f"index {t_pos} (teacher length {n_t}); both positions must be >= 1"
                    )
                if self.teacher_input_ids[t_pos] != self.input_ids[pos]:
                    raise ValueError(
                        f"sample {self.task_id}: token {pos} is {self.input_ids[pos]} but the "
                        f"teacher token at {t_pos} is {self.teacher_input_ids[t_pos]}"
                    )
        if self.advantages is None and self.n_live_rl_tokens:
            raise ValueError(
                f"sample {self.task_id} ({self.source}): advantages is None but "
                f"{self.n_live_rl_tokens} trainable tokens have rl weight; give advantages or "
                "set rl_weights to zeros for a sample without rl credit"
            )
        if (
            self.ref_kl_weights is not None
            and any(self.ref_kl_weights)
            and (self.ref_logprobs is None)
        ):
            raise ValueError(
                f"sample {self.task_id}: ref_kl_weights are set but ref_logprobs is missing"
            )

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def n_live_rl_tokens(self) -> int:
        """Trainable tokens with a non-zero rl weight (absent stream: weight 1)."""
        weights = self.rl_weights or [1.0] * len(self.loss_mask)
        return sum(1 for m, w in zip(self.loss_mask, weights) if m and w != 0)


_SAMPLE_FIELDS = frozenset(TrainingSample.__dataclass_fields__)


def to_device(tensor: Tensor, device: Any) -> Tensor:
    """``tensor`` on ``device`` without making the host wait (itself when already there).

    A host tensor bound for a GPU is copied from pinned memory with ``non_blocking``: the copy
    is queued on the device's stream, before every kernel that reads it, and the host goes on
    (a copy from pageable memory would wait for all queued work first)."""
    import torch

    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def flat_positions(mask: Tensor) -> Tensor:
    """(M,) flat indices of the True entries of a host ``mask`` (row-major, as ``x[mask]``
    takes them): lets the device gather rows without a boolean index, which needs ``nonzero``
    and so a host read of the device."""
    return mask.reshape(-1).nonzero().squeeze(-1)


@dataclass
class PairRows:
    """A micro-batch's preference pairs as right-padded rows: every pair's chosen side, then
    every rejected side, as :func:`pair_rows` builds them on the host.

    Attributes:
        input_ids, attention_mask, response_mask: (2P, W), padded with 0.
        head_rows: flat indices into (2P, W - 1) of the response tokens that have a log-prob
            (every response position but the first).
        weights: (P,) float64 pair weights.
        tokens: each row's token ids, host lists (a forward plans shared prefixes from them).
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    head_rows: Tensor
    weights: Tensor
    tokens: list[list[int]]

    @property
    def device(self) -> Any:
        return self.input_ids.device

    def to(self, device: Any) -> PairRows:
        """The same rows on ``device`` (non-blocking from the host; itself when already there)."""
        moved = {
            name: to_device(getattr(self, name), device)
            for name in ("input_ids", "attention_mask", "response_mask", "head_rows", "weights")
        }
        return replace(self, **moved)


def pair_key(pair: DPOPairTokens) -> tuple[Any, ...]:
    """What makes two pairs the same training signal: both sides' token ids and response
    masks (prompt, chosen and rejected tokens), and the cached reference log-probs."""
    return (
        tuple(pair.chosen_ids),
        tuple(pair.chosen_mask),
        tuple(pair.rejected_ids),
        tuple(pair.rejected_mask),
        pair.ref_chosen_logp,
        pair.ref_rejected_logp,
    )


def merge_repeated_pairs(
    pairs: Sequence[DPOPairTokens],
) -> tuple[list[DPOPairTokens], list[float]]:
    """``(unique, weights)``: each distinct pair (by :func:`pair_key`) once, first copy
    first, with the summed ``weight`` of its copies.

    A pair drawn k times adds ``sum_i w_i * loss`` to the dpo component, which is
    ``(sum_i w_i) * loss`` of one forward: the merged pairs give the same loss and gradient
    with 2 rows per distinct pair instead of 2 per copy. The first copy stands for the
    others (reference log-probs computed in a step are cached on it; the pair pool hands
    out the same object for every draw of a pair)."""
    unique: dict[tuple[Any, ...], int] = {}
    kept: list[DPOPairTokens] = []
    weights: list[float] = []
    for pair in pairs:
        key = pair_key(pair)
        slot = unique.get(key)
        if slot is None:
            unique[key] = len(kept)
            kept.append(pair)
            weights.append(float(pair.weight))
        else:
            weights[slot] += float(pair.weight)
    return kept, weights


def pair_rows(pairs: Sequence[DPOPairTokens], weights: Sequence[float] | None = None) -> PairRows:
    """The pairs' :class:`PairRows`, host tensors (built from lists: no tensor is read).

    ``weights``: one per pair (a merged pair's summed weight, :func:`merge_repeated_pairs`);
    the pairs' own ``weight`` by default."""
    import torch

    if weights is not None and len(weights) != len(pairs):
        raise ValueError(
            f"pair_rows: {len(weights)} weights for {len(pairs)} pairs; give one per pair"
        )
    seqs = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    masks = [p.chosen_mask for p in pairs] + [p.rejected_mask for p in pairs]
    width = max((len(s) for s in seqs), default=0)
    host = {"dtype": torch.long, "device": "cpu"}
    # from the lists, not the tensors: a step builds these for the reference forward
    head_rows = [
        row * (width - 1) + position - 1
        for row, mask in enumerate(masks)
        for position, value in enumerate(mask)
        if position and value
    ]
    weights = [p.weight for p in pairs] if weights is None else list(weights)
    return PairRows(
        input_ids=torch.tensor(pad_lists(seqs, width, 0), **host),
        attention_mask=torch.tensor(pad_lists([[1] * len(s) for s in seqs], width, 0), **host),
        response_mask=torch.tensor(pad_lists(masks, width, 0), **host),
        head_rows=torch.tensor(head_rows, **host),
        weights=torch.tensor(weights, dtype=torch.float64, device="cpu"),
        tokens=[list(s) for s in seqs],
    )


@dataclass
class MicroBatch:
    """Samples packed as right-padded (B, T) rows, plus the preference pairs they carry.

    Streams a micro-batch does not use at all are None. ``has_rl_stream`` marks the rows
    whose sample gave an explicit ``rl_weights`` (others get weight 1 on trainable tokens,
    already folded into ``rl_weights``).

    Besides the streams, packing records on the host what the trainer step would otherwise
    read back from the device (each read makes the host wait for the device):

    - ``counts``: per component, the tokens (pairs, for dpo) with a non-zero weight;
    - ``head_rows``: flat indices into (B, T - 1) of the positions whose log-prob a stream
      needs (trainable or ce-weighted next tokens); ``trainable_rows``: those of the
      trainable ones;
    - ``jsd_tokens``: (4, M) per jsd token (non-zero weight): batch row, student position,
      teacher position, and the index of its row in ``jsd_rows``, the (R,) rows that
      have jsd tokens (their teacher contexts are the ones the teacher forward runs on);
    - ``pair_rows``: the pairs as padded rows (:class:`PairRows`).

    ``pairs`` holds each distinct pair once (:func:`merge_repeated_pairs`): a pair drawn k
    times in the micro-batch is one pair whose ``pair_rows.weights`` entry is the sum of
    the copies' weights, while ``counts["dpo"]`` still counts every copy with a non-zero
    weight (the step divides by the pairs drawn, as before the merge).

    ``weights`` holds the (B, T) streams of registered loss components, by stream name.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    inference_logprobs: Tensor
    advantages: Tensor
    rl_weights: Tensor
    ce_weights: Tensor | None
    ref_kl_weights: Tensor | None
    jsd_weights: Tensor | None
    ref_logprobs: Tensor | None
    teacher_input_ids: Tensor | None
    teacher_attention_mask: Tensor | None
    teacher_index: Tensor | None
    pairs: list[DPOPairTokens]
    samples: list[TrainingSample]
    counts: dict[str, int]
    head_rows: Tensor
    trainable_rows: Tensor
    jsd_tokens: Tensor | None
    jsd_rows: Tensor | None
    pair_rows: PairRows | None
    weights: dict[str, Tensor] = field(default_factory=dict)

    def stream(self, name: str) -> Tensor | None:
        """The (B, T) stream ``name``: a field, or a registered component's in :attr:`weights`."""
        if name in _BATCH_FIELDS:
            return getattr(self, name)
        return self.weights.get(name)

    @property
    def n_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def device(self) -> Any:
        """Where the micro-batch's tensors are."""
        return self.input_ids.device

    @property
    def row_samples(self) -> list[TrainingSample]:
        """The samples behind the (B, T) rows, in row order."""
        return [s for s in self.samples if s.n_tokens]

    @property
    def forward_tokens(self) -> int:
        """Tokens the micro-batch's forwards compute with shared prefixes computed once (no
        padding): the distinct tokens of its student rows, of the teacher contexts of
        ``jsd_rows`` and of its pairs' rows (what :func:`pack_samples` holds to
        ``max_tokens``; counted on the host)."""
        load = ForwardLoad()
        for sample in self.samples:
            load.add(sample)
        return load.tokens

    def row_tokens(self) -> list[list[int]]:
        """Each row's token ids (host lists, no padding)."""
        return [s.input_ids for s in self.row_samples]

    def teacher_tokens(self) -> list[list[int]]:
        """The teacher context ids of the rows in ``jsd_rows``, in that order (host lists)."""
        return [
            s.teacher_input_ids or []
            for s in self.row_samples
            if s.jsd_weights is not None and any(s.jsd_weights)
        ]

    def to(self, device: Any) -> MicroBatch:
        """The same micro-batch with every tensor on ``device`` (itself when already there).

        Host tensors bound for a GPU are copied without blocking (:func:`to_device`); pairs,
        samples and counts stay host data."""
        import torch

        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        moved: dict[str, Any] = {
            name: value.to(device) if isinstance(value, PairRows) else to_device(value, device)
            for name, value in vars(self).items()
            if isinstance(value, (torch.Tensor, PairRows))
        }
        moved["weights"] = {k: to_device(v, device) for k, v in self.weights.items()}
        return replace(self, **moved)

    def assert_aligned(self) -> None:
        """Every (B, T) tensor has the shape of ``input_ids`` (the packing invariant)."""
        shape = tuple(self.input_ids.shape)
        for name in ("attention_mask", "loss_mask", *TOKEN_STREAMS, "teacher_index", *self.weights):
            value = self.stream(name)
            if value is not None and tuple(value.shape) != shape:
                raise AssertionError(
                    f"micro-batch stream {name} has shape {tuple(value.shape)}, "
                    f"input_ids has {shape}"
                )
        t_ids, t_attn = self.teacher_input_ids, self.teacher_attention_mask
        if t_ids is not None and t_attn is not None and t_ids.shape != t_attn.shape:
            raise AssertionError("teacher_input_ids and teacher_attention_mask differ")


_BATCH_FIELDS = frozenset(MicroBatch.__dataclass_fields__)


def pack_samples(
    samples: Sequence[TrainingSample],
    *,
    max_tokens: int,
    pad_id: int = 0,
    split: HeldoutSplit | None = DEFAULT_SPLIT,
    device: Any = None,
) -> list[MicroBatch]:
    """Pack samples into micro-batches of at most ``max_tokens`` computed tokens each.

    The budget counts every token a micro-batch's forwards compute
    (:attr:`MicroBatch.forward_tokens`): the distinct tokens of its student rows, of the
    teacher contexts of its jsd samples and of its preference pairs' rows, each shared
    prefix once (a group's prompt, a pair's prompt), as the learner's forwards compute them
    (a token trie in one packed forward; without prefix sharing a forward computes its
    padded rows instead, which may be more). Saved activations grow with this number, so
    it bounds the learner's peak memory per micro-batch.

    Tensors are built on the host and, with ``device``, moved there once per micro-batch
    (the trainer step also moves micro-batches to the policy's device itself).

    A sample whose ``task_id`` ``split`` holds out raises ``HeldoutLeakError`` (the
    project's split by default; a run passes its own; None for data with no held-out pool).

    Samples with tokens are sorted by length first so little is wasted on padding, and
    fill micro-batches in that order. Pair-only samples (empty ``input_ids``) are merged
    by pair (:func:`merge_repeated_pairs`: identical pairs of the call are trained once,
    their weights summed) and spread over the micro-batches, each into the first that has
    room, narrowest first; those that fit nowhere open new ones. A sample, or a pair, that
    alone exceeds ``max_tokens`` gets a micro-batch of its own (it cannot be split without
    changing its loss). The losses divide by counts taken over all micro-batches of a step,
    so how the samples are spread does not change the loss.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    for sample in samples:
        sample.check_alignment()
    if split is not None:
        split.check_trainable([s.task_id for s in samples if s.task_id])
    groups: list[list[TrainingSample]] = []
    loads: list[ForwardLoad] = []
    for sample in sorted((s for s in samples if s.n_tokens), key=lambda s: s.n_tokens):
        if not groups or loads[-1].tokens + loads[-1].cost(sample) > max_tokens:
            groups.append([])
            loads.append(ForwardLoad())
        groups[-1].append(sample)
        loads[-1].add(sample)
    for unit in _pair_units([s for s in samples if not s.n_tokens]):
        room = next(
            (i for i, load in enumerate(loads) if load.tokens + load.cost(unit[0]) <= max_tokens),
            None,
        )
        if room is None:  # no room anywhere (or too wide for any budget): one of its own
            groups.append([])
            loads.append(ForwardLoad())
            room = len(groups) - 1
        groups[room].extend(unit)
        loads[room].add(unit[0])
    empty = [s for s in samples if not s.n_tokens and s.dpo is None]  # nothing to train
    if empty:
        if groups:
            groups[0].extend(empty)
        else:
            groups.append(empty)
    batches = [_to_micro_batch(group, pad_id) for group in groups]
    for batch in batches:
        batch.assert_aligned()
    if device is None:
        return batches
    return [batch.to(device) for batch in batches]


def _pair_units(pair_only: list[TrainingSample]) -> list[list[TrainingSample]]:
    """Pair-only samples grouped by pair (:func:`pair_key`; copies of a pair always share a
    micro-batch, where they merge), narrowest pair first."""
    units: dict[tuple[Any, ...], list[TrainingSample]] = {}
    for sample in pair_only:
        if sample.dpo is not None:
            units.setdefault(pair_key(sample.dpo), []).append(sample)
    return sorted(units.values(), key=_pair_width)


def _pair_width(unit: list[TrainingSample]) -> int:
    pair = unit[0].dpo
    return max(len(pair.chosen_ids), len(pair.rejected_ids)) if pair is not None else 0


def _stream_tensor(rows: list[TrainingSample], name: str, width: int, dtype: Any) -> Tensor:
    import torch

    out = torch.zeros(len(rows), width, dtype=dtype, device="cpu")
    for i, sample in enumerate(rows):
        value = sample.stream(name)
        if value is not None and len(value):
            out[i, : len(value)] = torch.tensor(value, dtype=dtype, device="cpu")
    return out


def _to_micro_batch(group: list[TrainingSample], pad_id: int) -> MicroBatch:
    import torch

    rows = [s for s in group if s.n_tokens]
    width = max((s.n_tokens for s in rows), default=0)
    host = {"dtype": torch.long, "device": "cpu"}
    ids, attn = pad_rows([s.input_ids for s in rows], pad_id, width=width)
    f32 = torch.float32
    loss_mask = _stream_tensor(rows, "loss_mask", width, f32)
    streams = {
        c.stream: _weight_stream(rows, c, loss_mask)
        for c in loss_components()
        if c.stream is not None
    }

    def optional(name: str) -> Tensor | None:
        if all(s.stream(name) is None for s in rows) or not rows:
            return None
        return _stream_tensor(rows, name, width, f32)

    teacher_ids = teacher_attn = teacher_index = None
    if any(s.teacher_input_ids is not None for s in rows):
        t_width = max(len(s.teacher_input_ids or ()) for s in rows)
        teacher_ids = torch.full((len(rows), t_width), pad_id, **host)
        teacher_attn = torch.zeros(len(rows), t_width, **host)
        teacher_index = torch.full((len(rows), width), -1, **host)
        for i, sample in enumerate(rows):
            if sample.teacher_input_ids is None:
                continue
            n_t = len(sample.teacher_input_ids)
            teacher_ids[i, :n_t] = torch.tensor(sample.teacher_input_ids, **host)
            teacher_attn[i, :n_t] = 1
            if sample.teacher_index is not None:
                teacher_index[i, : sample.n_tokens] = torch.tensor(sample.teacher_index, **host)
    drawn = [s.dpo for s in group if s.dpo is not None]
    pairs, pair_weights = merge_repeated_pairs(drawn)
    trainable = loss_mask[:, 1:] != 0
    needed = trainable  # positions whose log-prob some component reads
    for component in loss_components():
        weights = streams.get(component.stream)
        if component.head_tokens and component.counts == "weighted" and weights is not None:
            needed = needed | (weights[:, 1:] != 0)
    jsd_tokens, jsd_rows = _jsd_tokens(streams["jsd_weights"], teacher_index)
    return MicroBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=loss_mask,
        inference_logprobs=_stream_tensor(rows, "inference_logprobs", width, f32),
        advantages=_stream_tensor(rows, "advantages", width, f32),
        **{name: value for name, value in streams.items() if name in _BATCH_FIELDS},
        ref_logprobs=optional("ref_logprobs"),
        teacher_input_ids=teacher_ids,
        teacher_attention_mask=teacher_attn,
        teacher_index=teacher_index,
        pairs=pairs,
        samples=list(group),
        counts=_component_counts(loss_mask, streams, drawn),
        head_rows=flat_positions(needed),
        trainable_rows=flat_positions(trainable),
        jsd_tokens=jsd_tokens,
        jsd_rows=jsd_rows,
        pair_rows=pair_rows(pairs, pair_weights) if pairs else None,
        weights={
            name: value
            for name, value in streams.items()
            if name not in _BATCH_FIELDS and value is not None
        },
    )


def _weight_stream(
    rows: list[TrainingSample], component: LossComponent, loss_mask: Tensor
) -> Tensor | None:
    """The (B, T) weights of ``component``'s stream; None when no row has it and its absence
    means off, else an absent row's weights as ``component.absent`` says."""
    import torch

    name = component.stream or ""
    present = [s.stream(name) is not None for s in rows]
    if component.absent == "off" and not any(present):
        return None
    weights = _stream_tensor(rows, name, loss_mask.shape[1], torch.float32)
    if component.absent == "trainable":
        for i, has in enumerate(present):
            if not has:  # absent stream: weight 1 on every trainable token
                weights[i] = loss_mask[i]
    return weights


def _component_counts(
    loss_mask: Tensor,
    streams: dict[str | None, Tensor | None],
    pairs: list[DPOPairTokens],
) -> dict[str, int]:
    """Per component, the next tokens (pairs) with a non-zero weight, as the component
    counts them, from host tensors; ``pairs`` are the pairs as drawn (every copy of a
    repeated pair counts)."""
    trainable = loss_mask[:, 1:] != 0
    counts: dict[str, int] = {}
    for component in loss_components():
        if component.counts == "pairs":
            counts[component.name] = sum(1 for p in pairs if p.weight != 0)
            continue
        weights = streams.get(component.stream)
        if weights is None:
            counts[component.name] = 0
            continue
        on = weights[:, 1:] != 0
        counts[component.name] = int(
            (on & trainable if component.counts == "trainable" else on).sum()
        )
    return counts


def _jsd_tokens(
    jsd_weights: Tensor | None, teacher_index: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """``(jsd_tokens, jsd_rows)`` of :class:`MicroBatch` from host tensors (None, None
    without a jsd stream)."""
    import torch

    if jsd_weights is None or teacher_index is None:
        return None, None
    rows, positions = (jsd_weights != 0).nonzero(as_tuple=True)
    teacher_rows, slots = torch.unique(rows, return_inverse=True)
    return torch.stack([rows, positions, teacher_index[rows, positions], slots]), teacher_rows
