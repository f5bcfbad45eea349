"""The decode loop's KV cache: preallocated layers, prompt states, and re-layout.

A batch's cache holds, per row, its prompt right-aligned behind left padding, then the
positions its forwards wrote; the attention mask says which positions a row attends to.
:func:`relayout` rebuilds that cache with only the attended positions of the live rows
and appends new rows from their prompt states: it drops the masked positions that
rejected drafts leave behind (compaction) and lets waiting prompts join a running batch
(continuous batching), in one copy.

A :class:`PromptState` is the model's state after a prompt (per-layer keys and values and
the last position's logits): a prompt is prefilled once per call, or once across calls
inside a :class:`PromptStates` store. A prompt that extends a stored one (an agent's next
turn: its last prompt, the reply, the observation) is prefilled from that state on, only
its new tokens forwarded (:func:`extend_state`); the store then drops the state it
extended, and keeps at most ``max_bytes`` of states (the oldest go first).

A forward writes into a cache passed with :func:`~composer_replication.common.compat.cache_kwargs`
(the keyword differs across the supported transformers releases).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from composer_replication.common.compat import SUPPORTED_TRANSFORMERS, cache_kwargs
from composer_replication.inference.decoding.padding import left_pad
from composer_replication.inference.decoding.uploads import to_device_async

__all__ = [
    "PREFILL_ROWS",
    "PREFILL_TOKENS",
    "PromptState",
    "PromptStates",
    "cache_capacity",
    "can_relayout",
    "compact_rows",
    "extend_state",
    "finished_row_state",
    "new_cache",
    "prompt_states",
    "relayout",
]

#: Prompts prefilled per forward: sorted by length, so a chunk carries little padding.
PREFILL_ROWS = 16
#: Padded prompt tokens per prefill forward at most (one longer prompt still goes alone):
#: a chunk's keys, values and attention grow with it (an agent's late turns: thousands of
#: tokens a prompt).
PREFILL_TOKENS = 8192


@dataclass(frozen=True)
class PromptState:
    """The model's state after one prompt: per layer its keys and values (heads, length,
    dim), and the float32 logits (vocab,) of its last position (None for a state taken
    from a finished row, which only later prompts extend)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor | None

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1])


class PromptStates:
    """Prompt states kept across decode calls of one model whose weights do not change
    meanwhile (an evaluation samples greedy and sampled answers of the same prompts; an
    agent's turns extend their earlier prompts).

    ``max_bytes`` bounds what it holds: a new state makes room by dropping the states used
    least recently.

    ``keep_finished`` (an agent's episodes: each turn's prompt extends its episode's last
    one and is sampled once): the decode loop keeps each finished row's state (its prompt
    and its tokens but the last, keys and values only) for the next turn to extend, and
    drops a prompt's kept state once its row is in the batch and no waiting row needs it;
    an episode's keys and values then exist once, in the batch or here, not in both.
    """

    def __init__(self, max_bytes: int = 4 << 30, *, keep_finished: bool = False) -> None:
        self.max_bytes = int(max_bytes)
        self.keep_finished = keep_finished
        self._states: dict[tuple[int, tuple[int, ...]], PromptState] = {}  # oldest first
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._states)

    @property
    def bytes(self) -> int:
        """What the kept states occupy."""
        return self._bytes

    def get(self, model: Any, prompt: tuple[int, ...]) -> PromptState | None:
        """The state of exactly ``prompt`` with its logits (a finished row's state has none:
        only a longer prompt can start from it)."""
        key = (id(model), prompt)
        state = self._states.pop(key, None)
        if state is not None:
            self._states[key] = state  # used: now the newest
        return state if state is not None and state.logits is not None else None

    def longest_prefix(
        self, model: Any, prompt: tuple[int, ...]
    ) -> tuple[tuple[int, ...], PromptState] | None:
        """The longest kept prompt that ``prompt`` extends (strictly), with its state."""
        best: tuple[tuple[int, ...], PromptState] | None = None
        for (owner, kept), state in self._states.items():
            if owner != id(model) or len(kept) >= len(prompt):
                continue
            if (best is None or len(kept) > len(best[0])) and prompt[: len(kept)] == kept:
                best = (kept, state)
        return best

    def put(self, model: Any, prompt: tuple[int, ...], state: PromptState) -> None:
        self.drop(model, prompt)
        size = _state_bytes(state)
        while self._states and self._bytes + size > self.max_bytes:
            oldest = next(iter(self._states))
            self._bytes -= _state_bytes(self._states.pop(oldest))
        self._states[(id(model), prompt)] = state
        self._bytes += size

    def drop(self, model: Any, prompt: tuple[int, ...]) -> None:
        state = self._states.pop((id(model), prompt), None)
        if state is not None:
            self._bytes -= _state_bytes(state)

    def drop_prefixes(self, tokens: Sequence[int]) -> int:
        """Drop every kept state whose prompt ``tokens`` begins with (an agent episode that
        ended: no later turn extends them); how many went."""
        tokens = tuple(int(t) for t in tokens)
        ended = [
            key
            for key in self._states
            if len(key[1]) <= len(tokens) and tokens[: len(key[1])] == key[1]
        ]
        for key in ended:
            self._bytes -= _state_bytes(self._states.pop(key))
        return len(ended)


def _state_bytes(state: PromptState) -> int:
    return sum(t.numel() * t.element_size() for t in (*state.keys, *state.values))


def extend_state(model: Any, state: PromptState, tokens: Sequence[int]) -> PromptState:
    """The state after ``tokens`` following the prompt ``state`` is the state of: one
    forward of the new tokens over the kept keys and values (the same numbers as a
    prefill of the whole prompt, up to float rounding)."""
    from transformers import DynamicCache

    device = state.keys[0].device
    cache = DynamicCache()
    for layer, (keys, values) in enumerate(zip(state.keys, state.values)):
        cache.update(keys[None], values[None], layer)
    start = state.length
    ids = to_device_async(torch.tensor([list(tokens)], dtype=torch.long, device="cpu"), device)
    out = model(
        input_ids=ids,
        position_ids=torch.arange(start, start + len(tokens), device=device)[None],
        use_cache=True,
        logits_to_keep=1,
        **cache_kwargs(cache),
    )
    # each layer's keys are a fresh concatenation the cache alone holds: no copy needed
    return PromptState(
        keys=[layer.keys[0] for layer in cache.layers],
        values=[layer.values[0] for layer in cache.layers],
        logits=out.logits[0, -1, :].float().clone(),
    )


def prompt_states(
    model: Any, prompts: Sequence[tuple[int, ...]], pad_id: int, store: PromptStates
) -> tuple[dict[tuple[int, ...], PromptState], int]:
    """Each distinct prompt's state, from ``store``, extended from the longest kept prompt
    it extends (that one is then dropped: the turn it served is over), or prefilled
    (length-sorted chunks of :data:`PREFILL_ROWS`, left-padded); each is added to the
    store. Also the prompt tokens forwarded."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    states: dict[tuple[int, ...], PromptState] = {}
    missing = []
    prefilled = 0
    bases: list[tuple[tuple[int, ...], tuple[int, ...], PromptState]] = []
    for prompt in dict.fromkeys(prompts):
        found = store.get(model, prompt)
        if found is not None:
            states[prompt] = found
            continue
        base = store.longest_prefix(model, prompt)
        if base is None:
            missing.append(prompt)
        else:
            bases.append((prompt, *base))
    # the turn a kept prompt served is over once every prompt extending it is extended:
    # dropped then, not at the end, so the old and new states of a batch are not all held
    extenders = Counter(kept for _, kept, _ in bases)
    for prompt, kept, state in bases:
        states[prompt] = extend_state(model, state, prompt[len(kept) :])
        prefilled += len(prompt) - len(kept)
        store.put(model, prompt, states[prompt])
        extenders[kept] -= 1
        if not extenders[kept]:
            store.drop(model, kept)
    missing.sort(key=len)
    for chunk in _prefill_chunks(missing):
        ids, mask = left_pad(chunk, pad_id, device=device)
        width = ids.shape[1]
        cache = DynamicCache()
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs(cache),
        )
        if not cache.layers:  # the forward took no cache under that keyword
            import transformers

            raise RuntimeError(
                f"{type(model).__name__} wrote nothing into the KV cache passed as "
                f"{', '.join(cache_kwargs(cache))}= under transformers {transformers.__version__}; "
                f"pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
            )
        prefilled += int(mask.sum())
        last = out.logits[:, -1, :].float()
        keys: list[list[torch.Tensor]] = [[] for _ in chunk]
        values: list[list[torch.Tensor]] = [[] for _ in chunk]
        for layer in cache.layers:  # each chunk layer goes once its rows are copied out
            for i, prompt in enumerate(chunk):
                begin = width - len(prompt)
                keys[i].append(layer.keys[i, :, begin:].clone())
                values[i].append(layer.values[i, :, begin:].clone())
            layer.keys = layer.values = None
        del cache, out
        for i, prompt in enumerate(chunk):
            state = PromptState(keys=keys[i], values=values[i], logits=last[i].clone())
            states[prompt] = state
            store.put(model, prompt, state)
    return states, prefilled


def finished_row_state(cache: Any, mask: torch.Tensor, row: int, length: int) -> PromptState:
    """Row ``row``'s keys and values at its first ``length`` attended positions (``mask``),
    copied out of a decode batch's ``cache``: the state of its prompt and the tokens it
    forwarded (logits None)."""
    positions = mask[row].nonzero().squeeze(-1)[:length]
    if positions.numel() != length:
        raise ValueError(f"row {row} attends to {positions.numel()} positions, not {length}")
    return PromptState(
        keys=[layer.keys[row].index_select(1, positions) for layer in cache.layers],
        values=[layer.values[row].index_select(1, positions) for layer in cache.layers],
        logits=None,
    )


def _prefill_chunks(prompts: Sequence[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Length-sorted ``prompts`` in consecutive chunks of at most :data:`PREFILL_ROWS`
    prompts and :data:`PREFILL_TOKENS` padded tokens (a longer prompt alone)."""
    chunks: list[list[tuple[int, ...]]] = []
    for prompt in prompts:
        chunk = chunks[-1] if chunks else None
        # sorted: this prompt is the chunk's longest, so it sets the padded width
        if (
            chunk is None
            or len(chunk) >= PREFILL_ROWS
            or (len(chunk) + 1) * len(prompt) > PREFILL_TOKENS
        ):
            chunks.append([prompt])
        else:
            chunk.append(prompt)
    return chunks


class _PreallocatedLayer:
    """A KV-cache layer that writes into buffers sized for the whole decode.

    The default cache grows by concatenation, copying the whole cache of every layer at
    every step; here each step writes its new positions in place and attention reads a
    view of the filled part. :func:`relayout` hands a layer buffers it filled itself
    (``adopt``), and :func:`compact_rows` moves the rows that stay down in place: neither
    allocates a second cache beside the first (on a CPU the freed blocks would stay
    resident as holes in the heap).
    """

    @staticmethod
    def make(capacity: int) -> Any:
        from transformers.cache_utils import DynamicLayer

        class PreallocatedLayer(DynamicLayer):
            preallocated = True
            positions = capacity

            def lazy_initialization(self, key_states: torch.Tensor, value_states: Any) -> None:
                rows, heads, _, dim = key_states.shape
                shape = (rows, heads, capacity, value_states.shape[-1])
                self.adopt(
                    key_states.new_empty((rows, heads, capacity, dim)),
                    value_states.new_empty(shape),
                    0,
                )

            def adopt(
                self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int
            ) -> None:
                """Take (rows, heads, capacity, dim) buffers whose first ``length``
                positions are written."""
                self.device, self.dtype = key_buffer.device, key_buffer.dtype
                self._key_buffer, self._value_buffer = key_buffer, value_buffer
                self.length = length
                self.keys = key_buffer[:, :, :length]
                self.values = value_buffer[:, :, :length]
                self.is_initialized = True

            def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                end = self.length + key_states.shape[-2]
                if end > capacity:
                    raise RuntimeError(f"KV cache capacity {capacity} exceeded ({end})")
                self._key_buffer[:, :, self.length : end] = key_states
                self._value_buffer[:, :, self.length : end] = value_states
                self.length = end
                self.keys = self._key_buffer[:, :, :end]
                self.values = self._value_buffer[:, :, :end]
                return self.keys, self.values

            def get_seq_length(self) -> int:
                return self.length if self.is_initialized else 0

            def keep_rows(self, rows: Sequence[int]) -> None:
                """Keep the rows ``rows`` (ascending), in that order, moved down in place."""
                if not self.is_initialized:
                    return
                n, end = len(rows), self.length
                on_host = self._key_buffer.device.type == "cpu"
                index = None if on_host else to_device_async(torch.tensor(rows), self.device)
                for buffer in (self._key_buffer, self._value_buffer):
                    if on_host:  # row by row: no block allocated (a CPU heap keeps holes)
                        for target, source in enumerate(rows):
                            # ascending: a source row is never a row an earlier move wrote
                            if target != source:
                                buffer[target, :, :end].copy_(buffer[source, :, :end])
                    else:  # two kernels, the written positions only
                        buffer[:n, :, :end] = buffer[index, :, :end]
                self.adopt(self._key_buffer[:n], self._value_buffer[:n], self.length)

            def batch_select_indices(self, indices: torch.Tensor) -> None:
                if self.is_initialized:
                    self.adopt(self._key_buffer[indices], self._value_buffer[indices], self.length)

        return PreallocatedLayer()


def new_cache(model: Any, capacity: int) -> Any:
    """A cache of preallocated layers for ``model``, or the default one if its layer count
    is unknown or it attends through a sliding window."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache

    config = getattr(model, "config", None)
    text_config = config.get_text_config(decoder=True) if config is not None else None
    n_layers = getattr(text_config, "num_hidden_layers", None)
    if not isinstance(n_layers, int) or getattr(text_config, "sliding_window", None):
        return DynamicCache()
    return Cache(layers=[_PreallocatedLayer.make(capacity) for _ in range(n_layers)])


def cache_capacity(cache: Any) -> int:
    """Positions ``cache`` can hold (unbounded unless it is preallocated)."""
    layers = getattr(cache, "layers", None) or [None]
    return int(getattr(layers[0], "positions", 1 << 62))


def can_relayout(cache: Any) -> bool:
    """Whether :func:`relayout` may rebuild ``cache`` (preallocated layers hold every
    position written; a sliding-window cache does not)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(getattr(layer, "preallocated", False) for layer in layers)


def compact_rows(cache: Any, rows: Sequence[int]) -> None:
    """Keep only the batch rows ``rows`` (ascending) of ``cache``: a preallocated cache
    moves them down in place (only the rows that move, only their written positions);
    another cache selects them."""
    rows = list(rows)
    if any(b <= a for a, b in itertools.pairwise(rows)):
        raise ValueError(f"rows {rows} must be ascending and distinct")
    if can_relayout(cache):
        for layer in cache.layers:
            layer.keep_rows(rows)
        return
    first = cache.layers[0].keys if getattr(cache, "layers", None) else None
    device = first.device if first is not None else "cpu"
    cache.batch_select_indices(torch.as_tensor(rows, dtype=torch.long, device=device))


@torch.no_grad()  # a decode's state: nothing to differentiate
def relayout(
    model: Any,
    cache: Any | None,
    mask: torch.Tensor | None,
    new_states: Sequence[PromptState],
    *,
    room: int,
    consumed: Sequence[bool] = (),
) -> tuple[Any, torch.Tensor]:
    """A new cache (and its (rows, width) mask) holding the attended positions of the rows
    of ``cache`` (``mask``; none when ``cache`` is None), then one row per state of
    ``new_states``, every row right-aligned; ``room`` positions are left for the forwards
    to come. Rows keep their order; the new rows come last.

    ``cache`` is consumed: each of its layers is emptied as soon as it is copied, so the
    copy needs one layer more than the larger of the two caches, not both caches whole.
    So is each new state whose ``consumed`` flag is True (a state nothing else will read:
    its layers are let go as they are copied)."""
    lengths: list[int] = []
    order: torch.Tensor | None = None
    if cache is not None and mask is not None and mask.shape[0]:
        keep = mask.bool()
        counts = keep.sum(-1)
        # each row's attended positions in order, right-aligned; the filler is masked
        order = torch.argsort(keep.to(torch.uint8), dim=-1, stable=True)[:, -int(counts.max()) :]
        lengths += counts.tolist()
    lengths += [state.length for state in new_states]
    if not lengths:
        raise ValueError("relayout needs at least one row")
    width = max(lengths)
    old_rows = len(lengths) - len(new_states)
    first = cache.layers[0].keys if order is not None else new_states[0].keys[0][None]
    device = first.device
    fresh = new_cache(model, width + room)
    n_layers = len(cache.layers) if order is not None else len(new_states[0].keys)
    for layer_index in range(n_layers):
        if order is not None:
            layer = cache.layers[layer_index]
            heads, dim = layer.keys.shape[1], layer.keys.shape[3]
            like = layer.keys
        else:
            layer = None
            heads, dim = new_states[0].keys[layer_index].shape[0], first.shape[3]
            like = new_states[0].keys[layer_index]
        # written in place: the room after ``width`` is filled by the forwards to come, the
        # filler before each row's positions is zero (masked, but read by the attention)
        key = like.new_empty((len(lengths), heads, width + room, dim))
        value = torch.empty_like(key)
        for buffer in (key, value):
            buffer[:, :, :width].zero_()
        if layer is not None and order is not None:
            span = order.shape[1]
            index = order[:, None, :, None].expand(-1, heads, -1, dim)
            torch.gather(layer.keys, 2, index, out=key[:old_rows, :, width - span : width])
            torch.gather(layer.values, 2, index, out=value[:old_rows, :, width - span : width])
            _empty_layer(layer)
        for row, state in enumerate(new_states, start=old_rows):
            span = int(state.keys[layer_index].shape[1])
            key[row, :, width - span : width] = state.keys[layer_index]
            value[row, :, width - span : width] = state.values[layer_index]
            if row - old_rows < len(consumed) and consumed[row - old_rows]:
                state.keys[layer_index] = state.values[layer_index] = _EMPTY
        if getattr(fresh.layers[layer_index], "preallocated", False):
            fresh.layers[layer_index].adopt(key, value, width)
        else:
            fresh.update(key[:, :, :width], value[:, :, :width], layer_index)
        del key, value
    offsets = torch.arange(width, device=device)[None, :]
    starts = to_device_async(torch.tensor([width - n for n in lengths], device="cpu"), device)[
        :, None
    ]
    return fresh, (offsets >= starts).long()


_EMPTY = torch.empty(0, 0, 0)


def _empty_layer(layer: Any) -> None:
    """Let go of a preallocated layer's buffers (its cache is being replaced)."""
    empty = layer.keys.new_empty((0,))
    layer._key_buffer = layer._value_buffer = layer.keys = layer.values = empty
