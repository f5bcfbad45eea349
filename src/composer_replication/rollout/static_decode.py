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

The host reads the window once every ``sync_every`` steps (one transfer). It then finds
where each row ended (EOS, a stop string, the token limit), and when the rows still going
fit a smaller bucket it moves them there (finished rows are trimmed; a row that ended
inside a window has decoded a few tokens too many, which are dropped). On CUDA each
step is a captured CUDA graph (one launch per token), optionally compiled first with
``torch.compile`` (fused kernels); on a CPU the same step runs eagerly or compiled.

The forward is :mod:`.llama_decoder`'s (Llama-family models); :func:`static_decoding_supported`
says whether a model qualifies.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_replication.rollout.decode import DecodedRow, DecodeStats
from composer_replication.rollout.llama_decoder import (
    BlockKernels,
    DecoderWeights,
    attention_inputs,
    block_output,
    decode_forward,
    prefill_forward,
    supports,
)

__all__ = [
    "SYNC_EVERY",
    "StaticDecoder",
    "static_decode_rows",
    "static_decoding_supported",
]

#: Default number of decode steps between two host reads of the batch.
SYNC_EVERY = 16
#: Cache capacity and attended width are multiples of this many columns.
WIDTH_STEP = 64
#: Smallest batch bucket (rows are rounded up to a power of two at least this).
MIN_BUCKET = 8
#: Most padded prompt tokens prefilled in one forward.
PREFILL_TOKENS = 16384


def static_decoding_supported(model: Any) -> str | None:
    """None when the static loop can decode ``model``; else the reason it cannot."""
    return supports(model)


def bucket_rows(rows: int, minimum: int = MIN_BUCKET) -> int:
    """The batch bucket for ``rows`` live rows: the next power of two, at least ``minimum``."""
    size = max(1, minimum)
    while size < rows:
        size *= 2
    return size


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


@dataclass
class _Bucket:
    """Device state of ``rows`` decoding rows over a cache of ``capacity`` columns."""

    rows: int
    capacity: int
    keys: torch.Tensor  # (layers, rows, kv_heads, capacity, dim)
    values: torch.Tensor
    valid: torch.Tensor  # (rows, capacity) bool: the columns a row attends to
    token: torch.Tensor  # (rows,) the last drawn token, input of the next step
    position: torch.Tensor  # (rows,) its position id
    step: torch.Tensor  # (1,) index of the token the next step draws
    column_base: torch.Tensor  # (1,) the cache column of token n's input is base + n
    uniforms: torch.Tensor  # (rows, tokens) float64, one per token
    temperature: torch.Tensor  # (1,) float32
    window_tokens: torch.Tensor  # (rows, sync_every) long
    window_logprobs: torch.Tensor  # (rows, sync_every) float32
    graphs: dict[tuple[int, bool], Any] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        return [
            self.keys,
            self.values,
            self.valid,
            self.token,
            self.position,
            self.step,
            self.column_base,
            self.uniforms,
            self.temperature,
            self.window_tokens,
            self.window_logprobs,
        ]


def _draw(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: torch.Tensor, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens drawn from ``softmax(logits / temperature)`` by inverting the float64 CDF at
    ``uniforms`` (argmax when ``greedy``), and their log-probs (at temperature 1 for
    greedy): the draw of :func:`~.decode.sample_categorical`, on the device."""
    if greedy:
        log_probs = torch.log_softmax(logits, dim=-1)
        token = logits.argmax(-1)
    else:
        log_probs = torch.log_softmax(logits / temperature, dim=-1)
        cdf = log_probs.double().exp().cumsum(-1)
        target = (uniforms[:, None] * cdf[:, -1:]).contiguous()
        token = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        token = token.clamp_max(logits.shape[-1] - 1)
    return token, log_probs.gather(-1, token[:, None]).squeeze(-1)


def _decode_step(
    w: DecoderWeights, b: _Bucket, width: int, greedy: bool, kernels: BlockKernels
) -> None:
    """One token for every row of ``b``, entirely on the device (see the module docstring)."""
    n = b.step
    column = b.column_base + n
    b.valid.index_fill_(1, column, True)
    logits = decode_forward(
        w,
        b.token,
        b.position,
        column,
        b.keys[:, :, :, :width],
        b.values[:, :, :, :width],
        b.valid[:, :width],
        kernels,
    )
    token, logprob = _draw(logits, b.uniforms.index_select(1, n)[:, 0], b.temperature, greedy)
    slot = n % b.window_tokens.shape[1]
    b.window_tokens.index_copy_(1, slot, token[:, None])
    b.window_logprobs.index_copy_(1, slot, logprob[:, None])
    b.token.copy_(token)
    b.position.add_(1)
    b.step.add_(1)


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


class _StopText:
    """Per row, the text of its new tokens (piece by piece, pieces cached per token id),
    checked for stop strings after each token."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.longest = max((len(s) for s in self.stop_strings), default=0)
        self.pieces: dict[int, str] = {}

    def hit(self, text: str, token: int) -> tuple[str, bool]:
        piece = self.pieces.get(token)
        if piece is None:
            piece = self.pieces[token] = self.tokenizer.decode([token])
        text += piece
        window = text[-(self.longest + len(piece)) :]
        return text, any(s in window for s in self.stop_strings)


class StaticDecoder:
    """The static loop's state for one model: its decode weights, the buckets' buffers and
    their captured graphs, kept across calls (the weights are refreshed in place per call,
    so the graphs stay valid).

    ``compile``: run the step through ``torch.compile``; ``graphs``: capture each step
    shape as a CUDA graph (CUDA only). ``compute_dtype``: dtype of the matrix products and
    the cache (the model's parameter dtype by default).
    """

    def __init__(
        self,
        model: Any,
        *,
        compute_dtype: torch.dtype | None = None,
        compile: bool = False,
        graphs: bool = False,
        sync_every: int = SYNC_EVERY,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every={sync_every} must be >= 1")
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
        }
        self.compile = compile
        self.graphs = graphs
        self.sync_every = sync_every
        self._buckets: dict[int, _Bucket] = {}  # by rows
        self._capacity = 0
        self._tokens = 0
        self._pool: Any = None
        self._kernels = BlockKernels()
        if compile:  # the block pieces only: no cache write or sampling inside (see BlockKernels)
            self._kernels = BlockKernels(
                torch.compile(attention_inputs, dynamic=None),
                torch.compile(block_output, dynamic=None),
            )
        if graphs:
            for tensor in self.weights.tensors():
                torch._dynamo.mark_static_address(tensor)

    # ------------------------------------------------------------------ buffers

    def _reserve(self, capacity: int, tokens: int) -> None:
        """Make every bucket hold at least ``capacity`` columns and ``tokens`` uniforms.

        All buckets share one capacity, the largest asked for so far: a call with shorter
        prompts attends over fewer columns of the same buffers (and replays the same graphs),
        so memory holds one set of buffers, whatever the calls' lengths.
        """
        if capacity <= self._capacity and tokens <= self._tokens:
            return
        self._capacity = max(capacity, self._capacity)
        self._tokens = max(tokens, self._tokens)
        self.release()

    def _bucket(self, rows: int) -> _Bucket:
        found = self._buckets.get(rows)
        if found is not None:
            return found
        capacity, tokens = self._capacity, self._tokens
        w, device = self.weights, self.device
        shape = (w.n_layers, rows, w.n_kv_heads, capacity, w.head_dim)
        bucket = _Bucket(
            rows=rows,
            capacity=capacity,
            keys=torch.zeros(shape, dtype=w.compute_dtype, device=device),
            values=torch.zeros(shape, dtype=w.compute_dtype, device=device),
            valid=torch.zeros((rows, capacity), dtype=torch.bool, device=device),
            token=torch.zeros(rows, dtype=torch.long, device=device),
            position=torch.zeros(rows, dtype=torch.long, device=device),
            step=torch.zeros(1, dtype=torch.long, device=device),
            column_base=torch.zeros(1, dtype=torch.long, device=device),
            uniforms=torch.zeros((rows, tokens), dtype=torch.float64, device=device),
            temperature=torch.ones(1, dtype=torch.float32, device=device),
            window_tokens=torch.zeros((rows, self.sync_every), dtype=torch.long, device=device),
            window_logprobs=torch.zeros((rows, self.sync_every), device=device),
        )
        if self.graphs:
            for tensor in bucket.tensors():
                torch._dynamo.mark_static_address(tensor)
        self._buckets[rows] = bucket
        return bucket

    def release(self) -> None:
        """Free every bucket's buffers and graphs (the next call allocates again)."""
        self._buckets.clear()

    # ------------------------------------------------------------------ steps

    def _run_step(self, bucket: _Bucket, width: int, greedy: bool, stats: DecodeStats) -> None:
        stats.forwards += 1
        if not self.graphs:
            _decode_step(self.weights, bucket, width, greedy, self._kernels)
            return
        key = (width, greedy)
        graph = bucket.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        # the first step of a shape runs for real on a side stream (warm-up, compilation),
        # then the same step is recorded for the next ones
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            _decode_step(self.weights, bucket, width, greedy, self._kernels)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        saved = [bucket.token.clone(), bucket.position.clone(), bucket.step.clone()]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            _decode_step(self.weights, bucket, width, greedy, self._kernels)
        # recording ran nothing, but keep the counters exactly as the real step left them
        bucket.token.copy_(saved[0])
        bucket.position.copy_(saved[1])
        bucket.step.copy_(saved[2])
        bucket.graphs[key] = graph

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
        stopper = _StopText(tokenizer, stop_strings) if stop_strings else None
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
        self, bucket: _Bucket, prompts: Sequence[Sequence[int]], width: int, stats: DecodeStats
    ) -> torch.Tensor:
        """Each distinct prompt prefilled once (length-sorted chunks); every row's cache
        filled from its prompt, right-aligned at column ``width``. Returns the (rows, vocab)
        logits of each row's last prompt position (rows past ``prompts`` copy row 0)."""
        w, device = self.weights, self.device
        slots_of: dict[tuple[int, ...], list[int]] = {}
        for slot in range(bucket.rows):
            key = tuple(int(t) for t in prompts[slot if slot < len(prompts) else 0])
            slots_of.setdefault(key, []).append(slot)
        distinct = sorted(slots_of, key=len)
        logits = torch.empty((bucket.rows, w.vocab), dtype=torch.float32, device=device)
        valid = torch.zeros((bucket.rows, bucket.capacity), dtype=torch.bool)
        for key, slots in slots_of.items():
            valid[slots, width - len(key) : width] = True
        bucket.valid.copy_(valid.to(device, non_blocking=True))
        begin = 0
        while begin < len(distinct):
            end = begin + 1
            while end < len(distinct) and (end + 1 - begin) * len(distinct[end]) <= PREFILL_TOKENS:
                end += 1
            chunk = distinct[begin:end]
            span = len(chunk[-1])
            ids = torch.zeros((len(chunk), span), dtype=torch.long)
            mask = torch.zeros((len(chunk), span), dtype=torch.bool)
            for i, key in enumerate(chunk):
                ids[i, span - len(key) :] = torch.tensor(key, dtype=torch.long)
                mask[i, span - len(key) :] = True
            shape = (w.n_layers, len(chunk), w.n_kv_heads, span, w.head_dim)
            keys = torch.empty(shape, dtype=w.compute_dtype, device=device)
            values = torch.empty_like(keys)
            last = prefill_forward(w, ids.to(device), mask.to(device), keys, values)
            stats.prefilled += sum(len(k) for k in chunk)
            source = [i for i, key in enumerate(chunk) for _ in slots_of[key]]
            slots = [s for key in chunk for s in slots_of[key]]
            slot_index = torch.tensor(slots, dtype=torch.long).to(device)
            source_index = torch.tensor(source, dtype=torch.long).to(device)
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
        stopper: _StopText | None,
        row_seeds: Sequence[int] | None,
        stats: DecodeStats,
        on_row_done: Callable[[int, DecodedRow], None] | None,
    ) -> None:
        device, k = self.device, self.sync_every
        greedy = temperature == 0
        width = max(len(p) for p in prompts)
        self._reserve(
            _round_up(width + max_new_tokens, WIDTH_STEP), _round_up(max_new_tokens, WIDTH_STEP)
        )
        bucket = self._bucket(bucket_rows(len(prompts)))
        tokens_cap = bucket.uniforms.shape[1]
        first_logits = self._prefill(bucket, prompts, width, stats)
        # the uniforms of every token, drawn before the loop
        if greedy:
            uniforms = None
        elif row_seeds is None:
            uniforms = torch.rand((bucket.rows, tokens_cap), dtype=torch.float64, device=device)
        else:
            host = torch.zeros((bucket.rows, tokens_cap), dtype=torch.float64)
            for slot, seed in enumerate(row_seeds):
                generator = torch.Generator().manual_seed(int(seed))
                host[slot, :max_new_tokens] = torch.rand(
                    max_new_tokens, dtype=torch.float64, generator=generator
                )
            uniforms = host.to(device, non_blocking=True)
        if uniforms is not None:
            bucket.uniforms.copy_(uniforms)
        bucket.temperature.fill_(max(temperature, 1e-30))
        token, logprob = _draw(first_logits, bucket.uniforms[:, 0], bucket.temperature, greedy)
        bucket.window_tokens[:, 0] = token
        bucket.window_logprobs[:, 0] = logprob
        bucket.token.copy_(token)
        lengths = [len(p) for p in prompts] + [len(prompts[0])] * (bucket.rows - len(prompts))
        bucket.position.copy_(torch.tensor(lengths, dtype=torch.long).to(device))
        bucket.step.fill_(1)
        bucket.column_base.fill_(width - 1)

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
                bucket = self._compact(bucket, live, smaller, stats)
                slot_rows = [slot_rows[s] for s in live] + [None] * (smaller - len(live))
        for row in range(len(prompts)):  # cannot happen: the token limit ends every row
            if row not in finished:
                results[rows[row]] = DecodedRow(out_tokens[row], out_logprobs[row], "length")

    def _launch(
        self,
        bucket: _Bucket,
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
                self._run_step(bucket, attended, greedy, stats)
        packed = torch.cat([bucket.window_tokens.double(), bucket.window_logprobs.double()], 1)
        if self.device.type != "cuda":
            return _Window(start, end, list(slot_rows), packed.cpu(), None)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Window(start, end, list(slot_rows), host, event)

    def _compact(self, bucket: _Bucket, live: list[int], rows: int, stats: DecodeStats) -> _Bucket:
        """A bucket of ``rows`` rows holding ``live``'s rows of ``bucket`` in order (the
        rest of its rows copy the first live row)."""
        target = self._bucket(rows)
        stats.compactions += 1
        chosen = live + [live[0]] * (rows - len(live))
        index = torch.tensor(chosen, dtype=torch.long).to(self.device)
        target.keys.copy_(bucket.keys.index_select(1, index))
        target.values.copy_(bucket.values.index_select(1, index))
        for name in ("valid", "token", "position", "window_tokens", "window_logprobs"):
            getattr(target, name).copy_(getattr(bucket, name).index_select(0, index))
        target.uniforms.copy_(bucket.uniforms.index_select(0, index))
        for name in ("step", "column_base", "temperature"):
            getattr(target, name).copy_(getattr(bucket, name))
        return target


_DECODERS: weakref.WeakKeyDictionary[Any, StaticDecoder] = weakref.WeakKeyDictionary()


_OPTIONS = ("compute_dtype", "compile", "graphs", "sync_every")


def decoder_for(model: Any, **options: Any) -> StaticDecoder:
    """The :class:`StaticDecoder` kept for ``model`` with these options (made on first use,
    made again when the options change)."""
    wanted = {"compute_dtype": None, "compile": False, "graphs": False, "sync_every": SYNC_EVERY}
    wanted.update(options)
    found = _DECODERS.get(model)
    if found is not None and found.options == wanted:
        return found
    if found is not None:
        found.release()
    decoder = StaticDecoder(model, **wanted)
    _DECODERS[model] = decoder
    return decoder


def static_decode_rows(
    model: Any, prompts: Sequence[Sequence[int]], **kwargs: Any
) -> list[DecodedRow]:
    """:meth:`StaticDecoder.decode` with the decoder kept for ``model`` (see
    :func:`decoder_for`); the decoder's options are taken out of ``kwargs``."""
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    return decoder_for(model, **options).decode(model, prompts, **kwargs)
