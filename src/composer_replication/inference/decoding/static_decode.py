"""The device-resident decode loop: static shapes, one host look every ``sync_every`` tokens.

A GPU decodes a small model's token in well under a millisecond, so a loop that launches
each operator from Python and reads the sampled tokens back after each step leaves it idle
most of the time. Here one decode step is a fixed sequence of device operations over
buffers whose shapes depend only on the batch bucket and the cache width:

- the KV cache is preallocated for the bucket (rows rounded up to a power of two) and a
  capacity (prompt width + new tokens, rounded up to :data:`WIDTH_STEP`); a step writes its
  keys and values in place at a column held in a device counter, and attends over the
  first ``width`` columns (the filled part, rounded up to :data:`WIDTH_STEP`);
- sampling runs on the device: the same inverse-CDF draw as the general loop
  (:func:`~.decode.sample_categorical`: float32 log-probs, float64 CDF, one uniform per
  token), with the uniforms drawn before the loop (from the row's own generator when rows
  are seeded: then a row samples exactly what the general loop samples for it);
- each step writes its tokens and log-probs into a window buffer of ``sync_every`` columns.

What the host builds for the device (padded prompts, row lengths, the seeded uniforms,
the rows a compaction keeps) goes up from pinned memory without a host wait
(:func:`.uploads.to_device_async`): a few copies per wave and per compaction, none per
token.

The host reads the window once every ``sync_every`` steps (one transfer). It then finds
where each row ended (EOS, a stop string, the token limit), and when the rows still going
fit a smaller bucket it moves them there (finished rows are trimmed; a row that ended
inside a window has decoded a few tokens too many, which are dropped). On CUDA each
step is a captured CUDA graph (one launch per token), optionally compiled first with
``torch.compile`` (fused kernels); on a CPU the same step runs eagerly or compiled.

Buckets come in shapes (cache capacity, uniforms per row): a wave whose prompts need a
larger capacity than any held shape gets a new shape, and the shapes held before keep
their buffers and graphs, up to ``keep_shapes`` of them (:func:`plan_shape` decides).

The device side (buckets, the step, its graphs) is :mod:`.decode_buckets`; the forward is
:mod:`.llama_decoder`'s (Llama-family models), and :func:`static_decoding_supported` says
whether a model qualifies.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from composer_replication.inference.decoding.decode import DecodedRow, DecodeStats, StopMatcher
from composer_replication.inference.decoding.decode_buckets import (
    Bucket,
    StepRunner,
    bucket_rows,
    draw,
)
from composer_replication.inference.decoding.llama_decoder import (
    BlockKernels,
    DecoderWeights,
    attention_inputs,
    block_output,
    prefill_forward,
    supports,
)
from composer_replication.inference.decoding.padding import left_pad
from composer_replication.inference.decoding.uploads import to_device_async

__all__ = [
    "SYNC_EVERY",
    "ShapePlan",
    "StaticDecoder",
    "decoder_for",
    "plan_shape",
    "static_decode_rows",
    "static_decoding_supported",
]

#: Default number of decode steps between two host reads of the batch.
SYNC_EVERY = 16
#: Cache capacity and attended width are multiples of this many columns.
WIDTH_STEP = 64
#: Most padded prompt tokens prefilled in one forward.
PREFILL_TOKENS = 16384


def static_decoding_supported(model: Any) -> str | None:
    """None when the static loop can decode ``model``; else the reason it cannot."""
    return supports(model)


def _host_longs(values: Sequence[int]) -> torch.Tensor:
    """A host tensor of ``values`` (built where the host keeps its bookkeeping, then moved
    in one copy)."""
    return torch.tensor(list(values), dtype=torch.long, device="cpu")


#: A bucket shape: (cache capacity in columns, uniforms per row).
Shape = tuple[int, int]


@dataclass(frozen=True)
class ShapePlan:
    """What a wave does to the held bucket shapes: decode in ``use`` (allocated when it is
    not held yet), after freeing ``free`` (their buffers and CUDA graphs)."""

    use: Shape
    free: tuple[Shape, ...]


def plan_shape(held: Sequence[Shape], capacity: int, tokens: int, keep: int) -> ShapePlan:
    """The shape a wave needing ``capacity`` columns and ``tokens`` uniforms decodes in.

    ``held``: the shapes held, least recently used first. The smallest held shape that fits
    is used as it is (its graphs replay). Otherwise a new shape is made and the oldest
    shapes are freed so that at most ``keep`` remain; the new shape also covers the shapes
    it frees (a wave that fitted one of them still fits), so with ``keep=1`` one set of
    buffers grows to the largest need. The shapes kept are untouched: a longer prompt
    captures the graphs of its new shape only.
    """
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    fitting = [s for s in held if s[0] >= capacity and s[1] >= tokens]
    if fitting:
        return ShapePlan(use=min(fitting), free=())
    free = tuple(held[: max(0, len(held) - keep + 1)])
    use = (max([capacity, *(s[0] for s in free)]), max([tokens, *(s[1] for s in free)]))
    return ShapePlan(use=use, free=free)


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


@dataclass
class _Window:
    """Tokens ``start`` to ``end`` (exclusive) of every slot, on their way to the host:
    ``host`` holds them (token ids, then log-probs) once ``event`` has completed;
    ``slot_rows`` is the row each slot decoded when the window was launched."""

    start: int
    end: int
    slot_rows: list[int | None]
    host: torch.Tensor
    event: Any


class StaticDecoder:
    """The static loop's state for one model: its decode weights, the buckets' buffers and
    their captured graphs, kept across calls (the weights are refreshed in place per call,
    so the graphs stay valid).

    ``compile``: run the step through ``torch.compile``; ``graphs``: capture each step
    shape as a CUDA graph (CUDA only). ``compute_dtype``: dtype of the matrix products and
    the cache (the model's parameter dtype by default). ``keep_shapes``: bucket shapes held
    at once (:func:`plan_shape`); by default 2 with ``graphs`` (a longer prompt leaves the
    graphs of the shorter ones in place, for up to twice the cache memory), else 1.
    """

    def __init__(
        self,
        model: Any,
        *,
        compute_dtype: torch.dtype | None = None,
        compile: bool = False,
        graphs: bool = False,
        sync_every: int = SYNC_EVERY,
        keep_shapes: int | None = None,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every={sync_every} must be >= 1")
        if keep_shapes is not None and keep_shapes < 1:
            raise ValueError(f"keep_shapes={keep_shapes} must be >= 1 (or None for the default)")
        parameter = next(model.parameters())
        self.device = parameter.device
        if graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.weights = DecoderWeights(model, compute_dtype or parameter.dtype)
        self.options = {
            "compute_dtype": compute_dtype,
            "compile": compile,
            "graphs": graphs,
            "sync_every": sync_every,
            "keep_shapes": keep_shapes,
        }
        self.compile = compile
        self.graphs = graphs
        self.sync_every = sync_every
        self.keep_shapes = keep_shapes if keep_shapes is not None else (2 if graphs else 1)
        # per shape (least recently used first), its buckets by rows
        self._shapes: dict[Shape, dict[int, Bucket]] = {}
        kernels = BlockKernels()
        if compile:  # the block pieces only: no cache write or sampling inside (see BlockKernels)
            kernels = BlockKernels(
                torch.compile(attention_inputs, dynamic=None),
                torch.compile(block_output, dynamic=None),
            )
        self._steps = StepRunner(self.weights, kernels, graphs=graphs)
        if graphs:
            for tensor in self.weights.tensors():
                torch._dynamo.mark_static_address(tensor)

    # ------------------------------------------------------------------ buffers

    def _reserve(self, capacity: int, tokens: int) -> Shape:
        """The shape a wave needing ``capacity`` columns and ``tokens`` uniforms decodes in
        (:func:`plan_shape`): the shapes it frees go, with their buffers and graphs; a wave
        with shorter prompts attends over fewer columns of a larger shape's buffers (and
        replays its graphs)."""
        plan = plan_shape(list(self._shapes), capacity, tokens, self.keep_shapes)
        for shape in plan.free:
            del self._shapes[shape]
        self._shapes[plan.use] = self._shapes.pop(plan.use, {})  # now the most recent
        return plan.use

    def _bucket(self, shape: Shape, rows: int) -> Bucket:
        buckets = self._shapes[shape]
        found = buckets.get(rows)
        if found is None:
            found = buckets[rows] = Bucket.allocate(
                self.weights,
                rows,
                shape[0],
                shape[1],
                self.sync_every,
                static_address=self.graphs,
            )
        return found

    def buckets(self) -> list[Bucket]:
        """Every bucket held, of every shape."""
        return [b for buckets in self._shapes.values() for b in buckets.values()]

    def release(self) -> None:
        """Free every bucket's buffers and graphs and the graphs' memory pool (the next call
        allocates and captures again)."""
        self._shapes.clear()
        self._steps.release()

    # ------------------------------------------------------------------ the loop

    def decode(
        self,
        model: Any,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        eos_ids: Sequence[int],
        tokenizer: Any = None,
        stop_strings: Sequence[str] = (),
        row_seeds: Sequence[int] | None = None,
        max_rows: int | None = None,
        stats: DecodeStats | None = None,
        on_row_done: Callable[[int, DecodedRow], None] | None = None,
    ) -> list[DecodedRow]:
        """One completion per prompt, as :func:`~.decode.decode_rows` samples it (EOS and
        stop strings kept, at most ``max_new_tokens``). ``max_rows``: rows decode in waves
        of at most this many. ``on_row_done(index, row)`` is called for each row as soon as
        the host sees it finished (at the next window boundary)."""
        if stop_strings and tokenizer is None:
            raise ValueError("stop strings need the tokenizer to decode the sampled tokens")
        if row_seeds is not None and len(row_seeds) != len(prompts):
            raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows={max_rows} must be >= 1 (or None for every row at once)")
        stats = stats if stats is not None else DecodeStats()
        self.weights.refresh(model)
        stopper = StopMatcher(tokenizer, stop_strings) if stop_strings else None
        results: list[DecodedRow | None] = [None] * len(prompts)
        wave = len(prompts) if max_rows is None else max_rows
        with torch.no_grad():
            for start in range(0, len(prompts), wave):
                rows = list(range(start, min(start + wave, len(prompts))))
                self._wave(
                    [prompts[r] for r in rows],
                    rows,
                    results,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    eos=frozenset(int(e) for e in eos_ids),
                    stopper=stopper,
                    row_seeds=None if row_seeds is None else [row_seeds[r] for r in rows],
                    stats=stats,
                    on_row_done=on_row_done,
                )
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _prefill(
        self,
        bucket: Bucket,
        prompts: Sequence[Sequence[int]],
        width: int,
        lengths: torch.Tensor,
        stats: DecodeStats,
    ) -> torch.Tensor:
        """Each distinct prompt prefilled once (length-sorted chunks); every row's cache
        filled from its prompt, right-aligned at column ``width``, and its valid columns set
        from its prompt length (``lengths``, (rows,) on the device). Returns the (rows,
        vocab) logits of each row's last prompt position (rows past ``prompts`` copy row 0).
        Two uploads per chunk: its padded prompts and its slot indices."""
        w, device = self.weights, self.device
        slots_of: dict[tuple[int, ...], list[int]] = {}
        for slot in range(bucket.rows):
            key = tuple(int(t) for t in prompts[slot if slot < len(prompts) else 0])
            slots_of.setdefault(key, []).append(slot)
        distinct = sorted(slots_of, key=len)
        logits = torch.empty((bucket.rows, w.vocab), dtype=torch.float32, device=device)
        columns = torch.arange(bucket.capacity, device=device)
        bucket.valid.copy_((columns >= width - lengths[:, None]) & (columns < width))
        begin = 0
        while begin < len(distinct):
            end = begin + 1
            while end < len(distinct) and (end + 1 - begin) * len(distinct[end]) <= PREFILL_TOKENS:
                end += 1
            chunk = distinct[begin:end]
            span = len(chunk[-1])
            ids, mask = left_pad(chunk, 0, device=device)
            shape = (w.n_layers, len(chunk), w.n_kv_heads, span, w.head_dim)
            keys = torch.empty(shape, dtype=w.compute_dtype, device=device)
            values = torch.empty_like(keys)
            last = prefill_forward(w, ids, mask.bool(), keys, values)
            stats.prefilled += sum(len(k) for k in chunk)
            source = [i for i, key in enumerate(chunk) for _ in slots_of[key]]
            slots = [s for key in chunk for s in slots_of[key]]
            slot_index, source_index = to_device_async(_host_longs(slots + source), device).view(
                2, -1
            )
            bucket.keys[:, slot_index, :, width - span : width] = keys[:, source_index]
            bucket.values[:, slot_index, :, width - span : width] = values[:, source_index]
            logits[slot_index] = last[source_index]
            begin = end
        return logits

    def _wave(
        self,
        prompts: Sequence[Sequence[int]],
        rows: list[int],
        results: list[DecodedRow | None],
        *,
        max_new_tokens: int,
        temperature: float,
        eos: frozenset[int],
        stopper: StopMatcher | None,
        row_seeds: Sequence[int] | None,
        stats: DecodeStats,
        on_row_done: Callable[[int, DecodedRow], None] | None,
    ) -> None:
        k = self.sync_every
        greedy = temperature == 0
        width = max(len(p) for p in prompts)
        bucket = self._start(prompts, max_new_tokens, temperature, row_seeds, stats)

        # host bookkeeping: per slot, the row it decodes (None: padding)
        slot_rows: list[int | None] = list(range(len(prompts))) + [None] * (
            bucket.rows - len(prompts)
        )
        out_tokens: list[list[int]] = [[] for _ in prompts]
        out_logprobs: list[list[float]] = [[] for _ in prompts]
        texts = [""] * len(prompts)
        finished: set[int] = set()

        def going() -> list[int]:
            return [s for s, r in enumerate(slot_rows) if r is not None and r not in finished]

        def read(window: _Window) -> None:
            """Extend each row by the window's tokens up to where it ends."""
            if window.event is not None:
                window.event.synchronize()
            table = window.host.tolist()
            for slot, row in enumerate(window.slot_rows):
                if row is None or row in finished:
                    continue
                reason = None
                for n in range(window.start, window.end):
                    token_id = int(table[slot][n % k])
                    out_tokens[row].append(token_id)
                    out_logprobs[row].append(float(table[slot][k + n % k]))
                    if token_id in eos:
                        reason = "eos"
                    elif stopper is not None:
                        texts[row], stopped = stopper.hit(texts[row], token_id)
                        reason = "stop" if stopped else None
                    if reason is None and len(out_tokens[row]) >= max_new_tokens:
                        reason = "length"
                    if reason is not None:
                        break
                if reason is not None:
                    finished.add(row)
                    done = DecodedRow(out_tokens[row], out_logprobs[row], reason)
                    results[rows[row]] = done
                    if on_row_done is not None:
                        on_row_done(rows[row], done)

        # The device runs one window ahead of the host: while the host reads window w
        # (ends rows, stop strings), window w + 1 decodes. Windows are aligned: token n sits
        # in window column n % k. Trimming happens after the host read a window; rows that
        # ended in the window already launched are dropped when it is read.
        in_flight: deque[_Window] = deque()
        launched = 0  # tokens drawn or being drawn per row
        while True:
            if launched < max_new_tokens and going():
                end = min(launched + k - launched % k, max_new_tokens)
                in_flight.append(
                    self._launch(bucket, slot_rows, launched, end, width, greedy, stats)
                )
                launched = end
                if len(in_flight) < 2 and launched < max_new_tokens:
                    continue  # keep one window decoding while the host reads the other
            if not in_flight:
                break
            read(in_flight.popleft())
            live = going()
            if not live:
                break
            smaller = bucket_rows(len(live))
            if smaller < bucket.rows:  # trim finished rows: move the live ones down
                bucket = self._compact(bucket, live, smaller)
                stats.compactions += 1
                slot_rows = [slot_rows[s] for s in live] + [None] * (smaller - len(live))
        for row in range(len(prompts)):  # cannot happen: the token limit ends every row
            if row not in finished:
                results[rows[row]] = DecodedRow(out_tokens[row], out_logprobs[row], "length")

    def _start(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        row_seeds: Sequence[int] | None,
        stats: DecodeStats,
    ) -> Bucket:
        """A wave's bucket ready for its token loop: prompts prefilled, the uniforms of
        every token drawn, token 0 drawn into the window, the counters set. Uploads: the
        row lengths, two per prefill chunk, and the uniforms when rows are seeded."""
        device = self.device
        greedy = temperature == 0
        width = max(len(p) for p in prompts)
        shape = self._reserve(
            _round_up(width + max_new_tokens, WIDTH_STEP), _round_up(max_new_tokens, WIDTH_STEP)
        )
        bucket = self._bucket(shape, bucket_rows(len(prompts)))
        tokens_cap = bucket.uniforms.shape[1]
        lengths = [len(p) for p in prompts] + [len(prompts[0])] * (bucket.rows - len(prompts))
        row_lengths = to_device_async(_host_longs(lengths), device)
        first_logits = self._prefill(bucket, prompts, width, row_lengths, stats)
        if greedy:
            pass
        elif row_seeds is None:
            bucket.uniforms.copy_(
                torch.rand((bucket.rows, tokens_cap), dtype=torch.float64, device=device)
            )
        else:  # each row's uniforms from its own generator, as the general loop draws them
            host = torch.zeros((bucket.rows, tokens_cap), dtype=torch.float64, device="cpu")
            for slot, seed in enumerate(row_seeds):
                generator = torch.Generator(device="cpu").manual_seed(int(seed))
                host[slot, :max_new_tokens] = torch.rand(
                    max_new_tokens, dtype=torch.float64, generator=generator, device="cpu"
                )
            bucket.uniforms.copy_(to_device_async(host, device))
        bucket.temperature.fill_(max(temperature, 1e-30))
        token, logprob = draw(first_logits, bucket.uniforms[:, 0], bucket.temperature, greedy)
        bucket.window_tokens[:, 0] = token
        bucket.window_logprobs[:, 0] = logprob
        bucket.token.copy_(token)
        bucket.position.copy_(row_lengths)
        bucket.step.fill_(1)
        bucket.column_base.fill_(width - 1)
        return bucket

    def _compact(self, bucket: Bucket, live: list[int], rows: int) -> Bucket:
        """The bucket of ``rows`` rows (same shape) holding the slots ``live`` of ``bucket``
        first, padded with copies of the first live slot (one upload: the slot index)."""
        shape = (bucket.capacity, bucket.uniforms.shape[1])
        target = self._bucket(shape, rows)
        chosen = live + [live[0]] * (rows - len(live))
        target.take_rows(bucket, to_device_async(_host_longs(chosen), self.device))
        return target

    def _launch(
        self,
        bucket: Bucket,
        slot_rows: list[int | None],
        start: int,
        end: int,
        width: int,
        greedy: bool,
        stats: DecodeStats,
    ) -> _Window:
        """Decode tokens ``start`` to ``end`` (exclusive; token 0 comes from the prefill) and
        queue the copy of the window to the host, without waiting for either."""
        first = max(start, 1)
        if end > first:
            attended = min(_round_up(width + end - 1, WIDTH_STEP), bucket.capacity)
            for _ in range(end - first):
                self._steps.run(bucket, attended, greedy)
            stats.forwards += end - first
        packed = torch.cat([bucket.window_tokens.double(), bucket.window_logprobs.double()], 1)
        if self.device.type != "cuda":
            return _Window(start, end, list(slot_rows), packed.cpu(), None)
        host = torch.empty(packed.shape, dtype=packed.dtype, device="cpu", pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Window(start, end, list(slot_rows), host, event)


_DECODERS: weakref.WeakKeyDictionary[Any, StaticDecoder] = weakref.WeakKeyDictionary()


_OPTIONS = ("compute_dtype", "compile", "graphs", "sync_every", "keep_shapes")


def decoder_for(model: Any, **options: Any) -> StaticDecoder:
    """The :class:`StaticDecoder` kept for ``model`` with these options (made on first use,
    made again when the options change)."""
    wanted = {
        "compute_dtype": None,
        "compile": False,
        "graphs": False,
        "sync_every": SYNC_EVERY,
        "keep_shapes": None,
    }
    wanted.update(options)
    found = _DECODERS.get(model)
    if found is not None and found.options == wanted:
        return found
    if found is not None:
        found.release()
    decoder = StaticDecoder(model, **wanted)
    _DECODERS[model] = decoder
    return decoder


def release_decoders(device_types: Sequence[str] = ("cuda",)) -> int:
    """:meth:`StaticDecoder.release` on every kept decoder whose model is on one of
    ``device_types``; how many were released."""
    released = [d for d in list(_DECODERS.values()) if d.device.type in device_types]
    for decoder in released:
        decoder.release()
    return len(released)


def static_decode_rows(
    model: Any, prompts: Sequence[Sequence[int]], **kwargs: Any
) -> list[DecodedRow]:
    """:meth:`StaticDecoder.decode` with the decoder kept for ``model`` (see
    :func:`decoder_for`); the decoder's options are taken out of ``kwargs``."""
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    return decoder_for(model, **options).decode(model, prompts, **kwargs)
