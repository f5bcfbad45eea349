"""The static decode loop's device side: batch buckets, the step, and its CUDA graphs.

A :class:`Bucket` holds everything one decode step reads and writes for a fixed number of
rows: the preallocated KV cache, the attention mask, each row's last token and position,
the step counters, the uniforms of every token and the window the step writes its tokens
and log-probs into. :func:`decode_step` is one token for every row on those buffers alone
(its column and token index are device counters), so the same step replays as one CUDA
graph (:class:`StepRunner`) whatever the token. The host-side loop is
:mod:`.static_decode`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from composer_replication.inference.decoding.llama_decoder import (
    BlockKernels,
    DecoderWeights,
    decode_forward,
)

__all__ = ["MIN_BUCKET", "Bucket", "StepRunner", "bucket_rows", "decode_step", "draw"]

#: Smallest batch bucket (rows are rounded up to a power of two at least this).
MIN_BUCKET = 8


def bucket_rows(rows: int, minimum: int = MIN_BUCKET) -> int:
    """The batch bucket for ``rows`` live rows: the next power of two, at least ``minimum``."""
    size = max(1, minimum)
    while size < rows:
        size *= 2
    return size


@dataclass
class Bucket:
    """Device state of ``rows`` decoding rows over a cache of ``capacity`` columns, and the
    CUDA graphs captured on it (by attended width and greediness)."""

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
    window_tokens: torch.Tensor  # (rows, window) long
    window_logprobs: torch.Tensor  # (rows, window) float32
    graphs: dict[tuple[int, bool], Any] = field(default_factory=dict)

    @classmethod
    def allocate(
        cls,
        w: DecoderWeights,
        rows: int,
        capacity: int,
        tokens: int,
        window: int,
        *,
        static_address: bool = False,
    ) -> Bucket:
        """Zeroed buffers on ``w``'s device; ``static_address``: marked as inputs whose
        address never changes (what graph capture and compilation rely on)."""
        device = w.device
        shape = (w.n_layers, rows, w.n_kv_heads, capacity, w.head_dim)
        bucket = cls(
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
            window_tokens=torch.zeros((rows, window), dtype=torch.long, device=device),
            window_logprobs=torch.zeros((rows, window), device=device),
        )
        if static_address:
            for tensor in bucket.tensors():
                torch._dynamo.mark_static_address(tensor)
        return bucket

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

    def take_rows(self, source: Bucket, index: torch.Tensor) -> None:
        """Fill every row with ``source``'s row ``index[row]`` (same capacity, same window);
        the counters are shared by all rows and copied as they are."""
        self.keys.copy_(source.keys.index_select(1, index))
        self.values.copy_(source.values.index_select(1, index))
        for name in ("valid", "token", "position", "window_tokens", "window_logprobs"):
            getattr(self, name).copy_(getattr(source, name).index_select(0, index))
        self.uniforms.copy_(source.uniforms.index_select(0, index))
        for name in ("step", "column_base", "temperature"):
            getattr(self, name).copy_(getattr(source, name))


def draw(
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


def decode_step(
    w: DecoderWeights, b: Bucket, width: int, greedy: bool, kernels: BlockKernels
) -> None:
    """One token for every row of ``b``, on the device alone: the forward of each row's last
    token (its keys and values written at the step's column, attention over the first
    ``width`` columns), the draw with the step's uniform, the token and log-prob written
    into the window, the counters advanced."""
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
    token, logprob = draw(logits, b.uniforms.index_select(1, n)[:, 0], b.temperature, greedy)
    slot = n % b.window_tokens.shape[1]
    b.window_tokens.index_copy_(1, slot, token[:, None])
    b.window_logprobs.index_copy_(1, slot, logprob[:, None])
    b.token.copy_(token)
    b.position.add_(1)
    b.step.add_(1)


class StepRunner:
    """Runs :func:`decode_step`, as it is or (``graphs``, CUDA) as a captured CUDA graph
    per bucket, attended width and greediness, all graphs sharing one memory pool."""

    def __init__(self, weights: DecoderWeights, kernels: BlockKernels, *, graphs: bool) -> None:
        self.weights = weights
        self.kernels = kernels
        self.graphs = graphs
        self._pool: Any = None

    def release(self) -> None:
        """Drop the graphs' memory pool (the buckets that held the graphs are freed by their
        owner): the next capture starts a new one."""
        self._pool = None

    def run(self, bucket: Bucket, width: int, greedy: bool) -> None:
        if not self.graphs:
            decode_step(self.weights, bucket, width, greedy, self.kernels)
            return
        key = (width, greedy)
        graph = bucket.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        # the first step of a shape runs for real on a side stream (warm-up, compilation),
        # then the same step is recorded for the next ones
        device = bucket.token.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            decode_step(self.weights, bucket, width, greedy, self.kernels)
        torch.cuda.current_stream(device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        saved = [bucket.token.clone(), bucket.position.clone(), bucket.step.clone()]
        graph = torch.cuda.CUDAGraph()
        # thread_local: the capture forbids unsafe CUDA calls in this thread only, so a
        # learner step in the trainer's thread can run while a sampler thread captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            decode_step(self.weights, bucket, width, greedy, self.kernels)
        # recording ran nothing, but keep the counters exactly as the real step left them
        bucket.token.copy_(saved[0])
        bucket.position.copy_(saved[1])
        bucket.step.copy_(saved[2])
        bucket.graphs[key] = graph
