"""Rows run packed end to end, without padding: one sequence of the rows' distinct tokens,
each token attending exactly to its own row's earlier tokens, through FlexAttention.

The rows become a token trie (rows that share a prefix hold its nodes once; rows sharing
nothing are separate chains, i.e. block-diagonal documents) whose N nodes are numbered in
pre-order: the rows are inserted in lexicographic order, so every node's subtree is the
contiguous index range ``[i, subtree_end[i])``. A token's row tokens are its ancestors,
and key ``j`` is an ancestor-or-self of query ``q`` exactly when ``j <= q < subtree_end[j]``:
the attention mask is that rule (a FlexAttention ``mask_mod``) over ONE (N,) vector, and
each token's position id is its depth (it restarts at every row that shares nothing).

The block-sparse mask (:func:`packed_block_mask`) is built on the device from that vector
alone, O(N + (N / block)^2): no (N, N) or (B, 1, T, T) mask exists on that path. Attention
runs through :data:`FLEX_KERNEL_DEVICES`' compiled FlexAttention kernel; on a CPU (where
torch 2.13's FlexAttention has no backward) one query tile at a time through SDPA over only
the key tiles the block mask lists for it, with the ``mask_mod`` evaluated on that tile
alone (:func:`tiled_attention`: the CPU kernel skips nothing a mask hides, so this is what
spares it the hidden work); on the ``meta`` device through SDPA with the ``mask_mod``
evaluated densely per packed sequence, a math reference.

The Hugging Face model is not forked: the body gets the :class:`BlockMask` as its
``attention_mask`` (transformers passes a 4-D mask through untouched) and the ``sdpa``
entry of transformers' ``AttentionInterface`` is wrapped once so that a BlockMask goes to
:func:`packed_attention` and every other mask to the original SDPA function (the wrapper
stays, so layers recomputed in backward under activation checkpointing find it too). A
model configured for ``flex_attention`` takes the BlockMask through transformers' own one.

Long layouts split into packed sequences of at most :data:`PACKED_SEQUENCE_TOKENS` tokens
(whole top-level subtrees each; a subtree longer than that is one sequence of its own), one
forward each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import Tensor
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "FLEX_KERNEL_DEVICES",
    "PACKED_SEQUENCE_TOKENS",
    "PACKING_DEVICES",
    "PackedLayout",
    "packed_attention",
    "packed_block_mask",
    "packed_forward",
    "packed_layout",
    "packing_applies",
    "sequence_ranges",
    "tile_key_runs",
    "tiled_attention",
    "visible",
]

#: Devices where learner forwards run packed by default.
PACKING_DEVICES: tuple[str, ...] = ("cuda", "cpu")
#: Devices whose FlexAttention kernel has a backward: attention runs compiled there, in
#: query tiles on a CPU (:func:`tiled_attention`), through the dense math reference elsewhere.
FLEX_KERNEL_DEVICES: tuple[str, ...] = ("cuda", "xpu", "hpu")
#: A packed sequence holds at most this many tokens (bounds one forward's activations and
#: its block mask); longer layouts take several forwards.
PACKED_SEQUENCE_TOKENS = 32768
#: FlexAttention's tile: the block mask classifies (query block, key block) pairs of it.
BLOCK_SIZE = 128
#: The tile of :func:`tiled_attention` on a CPU: fewer, larger SDPA calls than FlexAttention's
#: tile pay there (2 cores, bfloat16, forward + backward of agent-sized tries: 256 about 10%
#: faster than 128, 512 slower again).
CPU_BLOCK_SIZE = 256
#: Attention implementations that take the BlockMask (``sdpa`` through the wrapper).
_PACKED_ATTENTION = ("sdpa", "flex_attention")


@dataclass(frozen=True)
class PackedLayout:
    """Rows laid out as one pre-order token forest (N nodes).

    Attributes:
        tokens: (N,) each node's token id.
        positions: (N,) each node's depth, its position id in the rows that hold it.
        subtree_end: (N,) node i's subtree is the index range ``[i, subtree_end[i])``.
        paths: per row, the node of each of its tokens (in the caller's row order).
    """

    tokens: list[int]
    positions: list[int]
    subtree_end: list[int]
    paths: list[list[int]]

    def __len__(self) -> int:
        return len(self.tokens)


def packed_layout(rows: Sequence[Sequence[int]], *, share: bool = True) -> PackedLayout:
    """The :class:`PackedLayout` of rows given as host token lists (no padding).

    ``share``: rows with a common prefix hold its nodes once (a token trie); False lays
    every row out as its own chain (block-diagonal documents, the rows' order kept).
    """
    order = sorted(range(len(rows)), key=lambda r: list(rows[r])) if share else range(len(rows))
    children: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    positions: list[int] = []
    parents: list[int] = []
    paths: list[list[int]] = [[] for _ in rows]
    for row in order:
        node, path = -1, paths[row]
        for position, token in enumerate(rows[row]):
            child = children.get((node, token)) if share else None
            if child is None:
                child = len(tokens)
                if share:
                    children[(node, token)] = child
                tokens.append(token)
                positions.append(position)
                parents.append(node)
            path.append(child)
            node = child
    # lexicographic insertion numbers nodes in pre-order: a subtree ends after its last
    # descendant, found by passing each node's end up to its parent (children come later)
    subtree_end = list(range(1, len(tokens) + 1))
    for node in range(len(tokens) - 1, -1, -1):
        parent = parents[node]
        if parent >= 0 and subtree_end[node] > subtree_end[parent]:
            subtree_end[parent] = subtree_end[node]
    return PackedLayout(tokens, positions, subtree_end, paths)


def sequence_ranges(layout: PackedLayout, budget: int) -> list[tuple[int, int]]:
    """``[start, stop)`` node ranges of the packed sequences: consecutive whole top-level
    subtrees, at most ``budget`` tokens each unless one subtree alone is longer."""
    if budget < 1:
        raise ValueError(f"budget={budget}: a packed sequence needs at least 1 token")
    ranges: list[tuple[int, int]] = []
    start = root = 0
    while root < len(layout):
        end = layout.subtree_end[root]
        if end - start > budget and root > start:
            ranges.append((start, root))
            start = root
        root = end
    if start < len(layout):
        ranges.append((start, len(layout)))
    return ranges


def visible(subtree_end: Tensor) -> Callable[[Any, Any, Tensor, Tensor], Tensor]:
    """The ``mask_mod`` of a packed sequence: key ``k`` is visible to query ``q`` iff
    ``k <= q < subtree_end[k]`` (k is q's ancestor or q itself).

    ``subtree_end``: (L,) with L at least the key length; entries past the sequence are 0
    (those keys are visible to no query)."""

    def mask_mod(batch: Any, head: Any, q: Tensor, k: Tensor) -> Tensor:
        return (k <= q) & (q < subtree_end[k])

    return mask_mod


def packed_block_mask(
    subtree_end: Tensor, block_size: int = BLOCK_SIZE, *, host_ends: Sequence[int] | None = None
) -> BlockMask:
    """The FlexAttention :class:`BlockMask` of one packed sequence, on ``subtree_end``'s device.

    ``subtree_end``: (n,) as in :class:`PackedLayout`, relative to the sequence's start.
    Key block b's keys are seen by exactly the queries ``[b * block, max end in b)`` (each
    key sees itself, so the ranges of consecutive keys join up), and by every query of a
    query block starting at or after b's last key and ending at or before the least end in
    b: that classifies each (query block, key block) pair as empty, full or partial from
    per-block maxima and minima, without an (n, n) tensor.

    ``host_ends``: the same ends as a host list; given, the mask is a
    :class:`TiledBlockMask` that also holds each query tile's key ranges
    (:func:`tile_key_runs`), for :func:`tiled_attention`.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = subtree_end.shape[0]
    n_blocks = -(-n // block_size)
    ends = subtree_end.new_zeros(n_blocks * block_size)
    ends[:n] = subtree_end
    per_block = ends.view(n_blocks, block_size)
    reach = per_block.amax(1)[None, :]  # (1, n_blocks), per key block
    floor = per_block.amin(1)[None, :]  # padding keys' 0 keeps a ragged last block partial
    starts = torch.arange(n_blocks, device=ends.device) * block_size
    q0, k0 = starts[:, None], starts[None, :]
    seen = (q0 + block_size > k0) & (q0 < reach)
    full = (k0 + block_size - 1 <= q0) & (floor >= q0 + block_size)
    partial = seen & ~full

    def ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
        # each query block's listed key blocks first (stable: ascending), as BlockMask wants
        count = blocks.sum(-1, dtype=torch.int32)
        index = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count[None, None], index[None, None]

    kv_num, kv_index = ordered(partial)
    full_num, full_index = ordered(full)
    kind = BlockMask if host_ends is None else _tiled_block_mask_class()
    mask = kind.from_kv_blocks(
        kv_num,
        kv_index,
        full_num,
        full_index,
        BLOCK_SIZE=block_size,
        mask_mod=visible(ends),
        seq_lengths=(n, n),
    )
    if host_ends is not None:
        mask.key_runs = tile_key_runs(host_ends, block_size)
    return mask


def tile_key_runs(subtree_end: Sequence[int], tile: int) -> list[list[tuple[int, int]]]:
    """Per query tile of a packed sequence, the ``[start, stop)`` key ranges holding every
    key it sees (adjacent key tiles joined), from the host's subtree ends: key tile b is seen
    by the query tile starting at q0 iff ``q0 + tile > b * tile`` and q0 is below the
    largest end in b, as :func:`packed_block_mask` classifies its blocks."""
    n = len(subtree_end)
    n_tiles = -(-n // tile)
    reach = [max(subtree_end[b * tile : (b + 1) * tile]) for b in range(n_tiles)]
    plan: list[list[tuple[int, int]]] = []
    for q_start in range(0, n, tile):
        runs: list[tuple[int, int]] = []
        for b in range(n_tiles):
            start, stop = b * tile, min(n, (b + 1) * tile)
            if not (q_start + tile > start and q_start < reach[b]):
                continue
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], stop)
            else:
                runs.append((start, stop))
        plan.append(runs)
    return plan


@functools.cache
def _tiled_block_mask_class() -> type:
    """:class:`TiledBlockMask`, made on first use (flex_attention is imported lazily)."""
    from torch.nn.attention.flex_attention import BlockMask

    class TiledBlockMask(BlockMask):
        """A :class:`BlockMask` that also holds, per query tile, the key ranges the tile sees
        (``key_runs``, planned on the host): what :func:`tiled_attention` slices."""

        key_runs: list[list[tuple[int, int]]]

    return TiledBlockMask


def packed_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: BlockMask,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention of one packed sequence under ``attention_mask`` (from
    :func:`packed_block_mask`), in transformers' attention-function convention.

    Args:
        query: (1, Hq, n, D); key / value: (1, Hkv, n, D), Hq a multiple of Hkv.

    Returns:
        ``((1, n, Hq, D) output, None)``: no attention weights.
    """
    if dropout:
        raise ValueError(f"dropout={dropout}: packed attention has none, use the padded path")
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"packed attention does not apply {name}: use the padded path")
    gqa = query.shape[1] != key.shape[1]
    if query.device.type in FLEX_KERNEL_DEVICES:
        out = _flex_kernel(query.device.type)(
            query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa
        )
    elif hasattr(attention_mask, "key_runs"):
        out = tiled_attention(query, key, value, attention_mask, scale=scaling)
    else:
        n = query.shape[-2]
        index = torch.arange(n, device=query.device)
        allowed = attention_mask.mask_mod(None, None, index[:, None], index[None, :])
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous(), None


def tiled_attention(
    query: Tensor, key: Tensor, value: Tensor, block_mask: BlockMask, *, scale: float | None
) -> Tensor:
    """Attention of one packed sequence, one query tile at a time (a CPU's packed kernel).

    Each tile of ``block_mask.BLOCK_SIZE`` queries attends through SDPA to the keys of its
    ``block_mask.key_runs`` (a :class:`TiledBlockMask` from :func:`packed_block_mask` with
    ``host_ends``; one run sliced, several gathered), under the ``mask_mod`` evaluated on
    those keys only: a (tile, keys seen) mask, never (n, n), and none of the work of the
    key tiles the tile cannot see (other rows' branches of the trie, the upper triangle).

    Args:
        query: (1, Hq, n, D); key / value: (1, Hkv, n, D), Hq a multiple of Hkv.

    Returns:
        (1, Hq, n, D), equal to the dense masked attention up to float rounding (each
        query's keys summed in another grouping), gradients included.
    """
    n = query.shape[-2]
    tile = block_mask.BLOCK_SIZE[0]
    positions = torch.arange(n, device=query.device)
    gqa = query.shape[1] != key.shape[1]
    out = []
    for q_block, runs in enumerate(block_mask.key_runs):
        if len(runs) == 1:
            keys = positions[runs[0][0] : runs[0][1]]
            k, v = key[:, :, runs[0][0] : runs[0][1]], value[:, :, runs[0][0] : runs[0][1]]
        else:
            keys = torch.cat([positions[start:stop] for start, stop in runs])
            k, v = key.index_select(2, keys), value.index_select(2, keys)
        start, stop = q_block * tile, min(n, (q_block + 1) * tile)
        queries = positions[start:stop]
        allowed = block_mask.mask_mod(None, None, queries[:, None], keys[None, :])
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, start:stop],
                k,
                v,
                attn_mask=allowed,
                scale=scale,
                enable_gqa=gqa,
            )
        )
    return torch.cat(out, dim=-2)


def _sequence_mask(ends: Tensor, host_ends: Sequence[int], start: int) -> BlockMask:
    """The block mask of one packed sequence (``ends`` relative to its ``start``): on a CPU
    in tiles of :data:`CPU_BLOCK_SIZE`, with their key ranges planned from ``host_ends``."""
    if ends.device.type != "cpu":
        return packed_block_mask(ends)
    return packed_block_mask(ends, CPU_BLOCK_SIZE, host_ends=[end - start for end in host_ends])


@functools.cache
def _flex_kernel(device_type: str) -> Callable[..., Tensor]:
    """FlexAttention compiled on an accelerator (the fused kernel; uncompiled it materialises
    the scores), as is inside a graph being compiled already and on a CPU (where compiling
    needs a C++ toolchain and the eager kernel serves as a check, forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cpu":
        return flex_attention
    compiled = torch.compile(flex_attention, dynamic=None)

    def kernel(*args: Any, **kwargs: Any) -> Tensor:
        if torch.compiler.is_compiling():
            return flex_attention(*args, **kwargs)
        return compiled(*args, **kwargs)

    return kernel


def _install_sdpa_dispatch() -> None:
    """Wrap transformers' ``sdpa`` attention function once: a :class:`BlockMask` mask goes to
    :func:`packed_attention`, anything else to the original function, unchanged."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(original, "_packed_dispatch", False):
        return

    def sdpa_or_packed(
        module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, **kwargs: Any
    ) -> tuple[Tensor, Any]:
        if isinstance(attention_mask, BlockMask):
            return packed_attention(module, query, key, value, attention_mask, **kwargs)
        return original(module, query, key, value, attention_mask, **kwargs)

    sdpa_or_packed._packed_dispatch = True  # type: ignore[attr-defined]
    AttentionInterface.register("sdpa", sdpa_or_packed)


def packing_applies(config: Any, device: Any, rows: Sequence[Sequence[int]]) -> bool:
    """Whether rows go packed on ``device`` for a model of ``config``: a device of
    :data:`PACKING_DEVICES`, SDPA or flex attention, no attention dropout or logit
    soft-capping, and no sliding window shorter than the longest row (the mask would
    bypass it)."""
    if torch.device(device).type not in PACKING_DEVICES:
        return False
    if getattr(config, "_attn_implementation", None) not in _PACKED_ATTENTION:
        return False
    if getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_logit_softcapping", None):
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or window >= max((len(row) for row in rows), default=0)


def packed_forward(
    body: Any,
    layout: PackedLayout,
    shape: tuple[int, int],
    *,
    device: Any,
    budget: int | None = None,
) -> Tensor:
    """(B, T) -> (B, T, H) last hidden states of ``body`` (a Hugging Face decoder body) over
    right-padded rows of ``shape``, from packed forwards of ``layout``'s N tokens.

    Padding positions get zero hidden states (no loss reads them). Gradients reach a shared
    token summed over the rows that hold it, as in the row-by-row forward. ``budget``: the
    packed sequences' token bound (default :data:`PACKED_SEQUENCE_TOKENS`).
    """
    from composer_replication.samples.wire import to_device

    if getattr(body.config, "_attn_implementation", None) == "sdpa":
        _install_sdpa_dispatch()
    n_rows, width = shape
    n_tokens = len(layout)
    # Every index is built on the host from the layout's lists and copied once, without
    # blocking (a tensor made from a list right on a GPU waits for the device).
    host = {"dtype": torch.long, "device": "cpu"}
    columns = torch.tensor([layout.tokens, layout.positions, layout.subtree_end], **host)
    where = [path + [n_tokens] * (width - len(path)) for path in layout.paths]
    index = torch.tensor(where, **host).reshape(n_rows, width)
    columns, index = to_device(columns, device), to_device(index, device)
    hidden = []
    for start, stop in sequence_ranges(layout, budget or PACKED_SEQUENCE_TOKENS):
        tokens, positions, ends = columns[:, start:stop]
        out = body(
            input_ids=tokens[None],
            attention_mask=_sequence_mask(ends - start, layout.subtree_end[start:stop], start),
            position_ids=positions[None],
            use_cache=False,
        )
        hidden.append(out.last_hidden_state[0])
    hidden.append(hidden[0].new_zeros(1, hidden[0].shape[-1]))  # what padding reads
    return torch.cat(hidden)[index]
