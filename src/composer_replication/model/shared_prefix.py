"""Final hidden states of rows that share prefixes, each shared prefix computed once.

The rows a step trains share long prefixes: a group's rollouts share their task prompt (and
every task the system prompt), the hinted teacher contexts of a group share everything
before the hint, and both sides of a trace-replay pair share the agent's prompt (and every
pair the agent's system prompt). A causal transformer's output at a position depends only on
the tokens up to it, so a shared prefix has the same hidden states in every row: computing
it once and letting the rows' remaining tokens attend to its keys and values (a key/value
cache repeated over the rows) gives the same hidden states for fewer tokens. Gradients flow
through the cache into the prefix's computation, summed over the rows that used it, as in
the row-by-row forward. Values agree with it up to float rounding (different matmul shapes).

Two ways to compute it here, both only for right-padded rows (as
:func:`composer_replication.samples.wire.pack_samples` and :func:`composer_replication.ops.pairs.pad_rows`
build them; anything else takes the plain forward). On a GPU, rows whose tokens the host
holds take neither: they run packed without padding or an (N, N) mask
(:mod:`composer_replication.model.packed_attention`).

- one packed forward (:func:`packed_prefix_forward`, the default where it applies): the rows'
  distinct prefixes form a token trie (:func:`token_trie`), its N nodes are one sequence
  with each token's depth as its position, and a dense (N, N) attention mask lets a token
  see exactly its ancestors. No padding, no cache, one forward: on 2 CPU cores the student
  rows of a composer step ran about 1.3-2x faster than a forward per tree node. It needs
  an attention that takes an explicit mask (SDPA or eager), no sliding window, and N at
  most :func:`packed_max_tokens` (the mask is materialised; fewer on a CPU, where the
  attention over it costs N squared);
- a forward per prefix-tree node (:func:`shared_prefix_forward`): rows with the same next
  ``min_prefix`` tokens form a node whose segment is their longest common continuation
  (each row keeps at least one token of its own), recursively; the rows left at a node take
  batched forwards on the node's cache.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from composer_replication.common.compat import cache_kwargs

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "BATCH_OVERHEAD_TOKENS",
    "DEFAULT_MIN_PREFIX",
    "PACKED_MAX_TOKENS",
    "PACKED_MAX_TOKENS_CPU",
    "PrefixNode",
    "TokenTrie",
    "length_batches",
    "packed_max_tokens",
    "packed_prefix_forward",
    "packed_prefix_trie",
    "prefix_sharing",
    "prefix_sharing_enabled",
    "prefix_tree",
    "shared_prefix_forward",
    "token_trie",
    "tree_forward_tokens",
]

#: Shorter shared segments are not worth a forward of their own.
DEFAULT_MIN_PREFIX = 16

_enabled = True


def prefix_sharing_enabled() -> bool:
    """Whether forwards share prefixes by default (see :func:`prefix_sharing`)."""
    return _enabled


@contextmanager
def prefix_sharing(enabled: bool) -> Iterator[None]:
    """Within the block, every forward shares prefixes (True) or runs rows in full (False);
    to compare both or rule sharing out while debugging."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = previous


@dataclass
class PrefixNode:
    """Rows that share tokens ``[start, end)`` (and, through the parents, all before)."""

    rows: list[int]
    start: int
    end: int
    children: list[PrefixNode] = field(default_factory=list)
    #: rows with no longer shared continuation: their tokens from ``end`` on
    leaves: list[int] = field(default_factory=list)
    #: where the longest leaf's real tokens end (padding after a leaf batch's longest row
    #: gets zero hidden states, which no loss reads)
    leaf_end: int = 0
    #: the leaves as batches of similar length, each ``(rows, stop)``: one forward each
    leaf_batches: list[tuple[list[int], int]] = field(default_factory=list)

    def shared_tokens(self) -> int:
        """Tokens this subtree saves against computing every row in full."""
        saved = (len(self.rows) - 1) * (self.end - self.start)
        return saved + sum(child.shared_tokens() for child in self.children)


def _right_padded_lengths(input_ids: Tensor, attention_mask: Tensor | None) -> list[int] | None:
    """Each row's real length, or None when some row is not ``1...1 0...0``."""
    n_rows, width = input_ids.shape
    if attention_mask is None:
        return [width] * n_rows
    mask = attention_mask.detach().to("cpu", torch.long)
    lengths = mask.sum(1)
    positions = torch.arange(width, device=mask.device).expand(n_rows, width)
    if not torch.equal(mask, (positions < lengths[:, None]).long()):
        return None
    return [int(n) for n in lengths]


def _split(
    ids: list[list[int]], lengths: list[int], rows: list[int], start: int, min_prefix: int
) -> tuple[list[PrefixNode], list[int]]:
    """Nodes of the rows that share at least ``min_prefix`` tokens from ``start`` on, and
    the rows that share nothing further."""
    by_start: dict[tuple[int, ...], list[int]] = {}
    alone: list[int] = []
    for row in rows:
        if lengths[row] - start > min_prefix:
            by_start.setdefault(tuple(ids[row][start : start + min_prefix]), []).append(row)
        else:
            alone.append(row)
    nodes = []
    for group in by_start.values():
        limit = min(lengths[r] for r in group) - 1  # every row keeps a token of its own
        first = ids[group[0]]
        end = start + min_prefix
        while end < limit and all(ids[r][end] == first[end] for r in group):
            end += 1
        if len(group) < 2:
            alone += group
            continue
        children, leaves = _split(ids, lengths, group, end, min_prefix)
        leaf_end = max((lengths[r] for r in leaves), default=end)
        batches = length_batches(leaves, lengths, end)
        nodes.append(PrefixNode(group, start, end, children, leaves, leaf_end, batches))
    return nodes, sorted(alone)


#: A forward of its own costs about this many tokens' worth of time (per-layer overhead).
BATCH_OVERHEAD_TOKENS = 24


def length_batches(rows: list[int], lengths: list[int], start: int) -> list[tuple[list[int], int]]:
    """``rows`` (whose tokens from ``start`` on are computed) as batches of similar length,
    each ``(rows, stop)``: the split that minimises padded tokens plus
    :data:`BATCH_OVERHEAD_TOKENS` per batch (an exact dynamic programme over the rows
    sorted by length)."""
    if not rows:
        return []
    ordered = sorted(rows, key=lambda r: lengths[r])
    n = len(ordered)
    # best[i]: cost of batching the i shortest rows; cut[i]: where their last batch starts
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        width = lengths[ordered[i - 1]] - start  # the longest of ordered[j:i]
        for j in range(i):
            cost = best[j] + (i - j) * width + BATCH_OVERHEAD_TOKENS
            if cost < best[i]:
                best[i], cut[i] = cost, j
    batches, i = [], n
    while i > 0:
        j = cut[i]
        batches.append((sorted(ordered[j:i]), lengths[ordered[i - 1]]))
        i = j
    return batches[::-1]


def prefix_tree(
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    min_prefix: int = DEFAULT_MIN_PREFIX,
    row_tokens: Sequence[Sequence[int]] | None = None,
) -> tuple[list[PrefixNode], list[int]]:
    """``(nodes, unshared_rows)``: the rows' shared-prefix tree (empty for rows that are
    not right-padded or share no ``min_prefix`` tokens) and the rows in no node.

    ``row_tokens``: each row's real tokens as host lists (the rows right-padded): the tree
    is built from them, without reading ``input_ids`` back from the device."""
    if min_prefix < 1:
        raise ValueError(f"min_prefix={min_prefix}: need at least 1 shared token")
    n_rows = input_ids.shape[0]
    if n_rows < 2:
        return [], list(range(n_rows))
    if row_tokens is not None:
        ids = [list(row) for row in row_tokens]
        return _split(ids, [len(row) for row in ids], list(range(n_rows)), 0, min_prefix)
    if input_ids.device.type == "meta":  # meta tensors hold no token values
        return [], list(range(n_rows))
    lengths = _right_padded_lengths(input_ids, attention_mask)
    if lengths is None:
        return [], list(range(n_rows))
    ids = input_ids.detach().to("cpu").tolist()
    return _split(ids, lengths, list(range(n_rows)), 0, min_prefix)


def tree_forward_tokens(
    tree: tuple[list[PrefixNode], list[int]], lengths: Sequence[int], width: int
) -> tuple[int, int]:
    """``(computed, padded)`` token positions :func:`shared_prefix_forward` computes over
    ``tree`` for rows of ``lengths`` real tokens padded to ``width``: the unshared rows in
    full, each node's segment once, each leaf batch up to its longest row."""
    nodes, unshared = tree
    computed = len(unshared) * width
    padded = computed - sum(lengths[r] for r in unshared)
    stack = list(nodes)
    while stack:
        node = stack.pop()
        computed += node.end - node.start
        for leaves, stop in node.leaf_batches:
            computed += len(leaves) * (stop - node.end)
            padded += sum(stop - lengths[r] for r in leaves)
        stack.extend(node.children)
    return computed, padded


def _branch(cache: Any) -> Any:
    """A cache that continues from ``cache`` without changing it (its layers' tensors are
    shared until the branch appends to them, which builds new ones)."""
    branch = copy.copy(cache)
    branch.layers = [copy.copy(layer) for layer in cache.layers]
    return branch


def shared_prefix_forward(
    body: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    tree: tuple[list[PrefixNode], list[int]],
) -> Tensor:
    """(B, T, H) last hidden states of ``body`` (a Hugging Face decoder body, called with
    ``input_ids``, ``attention_mask``, ``use_cache`` and a KV cache) over the rows, each
    shared prefix of ``tree`` (from :func:`prefix_tree`) computed once."""
    n_rows = input_ids.shape[0]
    pieces: dict[int, list[Tensor]] = {row: [] for row in range(n_rows)}
    nodes, unshared = tree
    if unshared:
        index = torch.tensor(unshared, device=input_ids.device)
        mask = None if attention_mask is None else attention_mask[index]
        out = body(input_ids=input_ids[index], attention_mask=mask, use_cache=False)
        for i, row in enumerate(unshared):
            pieces[row].append(out.last_hidden_state[i])
    for node in nodes:
        _node_forward(body, input_ids, attention_mask, node, None, pieces)
    return torch.stack([torch.cat(pieces[row], dim=0) for row in range(n_rows)])


def _node_forward(
    body: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    node: PrefixNode,
    cache: Any | None,
    pieces: dict[int, list[Tensor]],
) -> None:
    from transformers import DynamicCache

    device = input_ids.device
    segment = input_ids[node.rows[0] : node.rows[0] + 1, node.start : node.end]
    seen = torch.ones((1, node.end), dtype=torch.long, device=device)
    # the forward writes the node's positions into this cache: the children continue it
    cache = DynamicCache(config=body.config) if cache is None else _branch(cache)
    out = body(input_ids=segment, attention_mask=seen, use_cache=True, **cache_kwargs(cache))
    shared = out.last_hidden_state[0]
    for row in node.rows:
        pieces[row].append(shared)
    for child in node.children:
        _node_forward(body, input_ids, attention_mask, child, cache, pieces)
    for leaves, stop in node.leaf_batches:
        index = torch.tensor(leaves, device=device)
        leaf_cache = _branch(cache)
        leaf_cache.batch_repeat_interleave(len(leaves))
        mask = torch.ones((len(leaves), stop), dtype=torch.long, device=device)
        if attention_mask is not None:
            mask[:, node.end :] = attention_mask[index, node.end : stop]
        tail = body(
            input_ids=input_ids[index, node.end : stop],
            attention_mask=mask,
            use_cache=True,
            **cache_kwargs(leaf_cache),
        ).last_hidden_state
        width = input_ids.shape[1]
        if stop < width:
            tail = torch.cat([tail, tail.new_zeros(len(leaves), width - stop, tail.shape[-1])], 1)
        for i, row in enumerate(leaves):
            pieces[row].append(tail[i])


#: The packed forward holds an (N, N) attention mask over the N distinct tokens (and the
#: attention its scores): above this many it gives way to a forward per tree node.
PACKED_MAX_TOKENS = 4096
#: The same bound on a CPU, lower: no CPU kernel skips the blocks the mask hides, so the
#: packed forward's attention is quadratic in N, where a forward per tree node attends within
#: each node's rows. Measured on 2 cores (embedded model, LoRA, bfloat16 autocast, forward +
#: backward): N = 950, 2.7 s packed vs 3.1 s per node; N = 1,900, 8.2 vs 7.0 s; N = 3,050
#: (5 agent episodes of 850 tokens), 19.2 vs 11.0 s.
PACKED_MAX_TOKENS_CPU = 1536
#: Attention implementations that take an explicit (B, 1, Q, K) mask: a boolean one
#: (SDPA) or an additive one (eager).
_MASKED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class TokenTrie:
    """The distinct prefixes of some rows: one node per distinct (prefix, token), so rows
    that agree up to and including position p hold the same node at p.

    Attributes:
        tokens: (N,) each node's token id; a parent always comes before its children.
        positions: (N,) each node's position in the rows that hold it (its depth).
        paths: per row, the node of each of its real (unpadded) positions.
    """

    tokens: list[int]
    positions: list[int]
    paths: list[list[int]]

    def __len__(self) -> int:
        return len(self.tokens)


def token_trie(input_ids: Tensor, attention_mask: Tensor | None = None) -> TokenTrie | None:
    """The rows' :class:`TokenTrie`, or None when some row is not right-padded (or the
    tokens live on the ``meta`` device, which holds no values)."""
    if input_ids.device.type == "meta":
        return None
    lengths = _right_padded_lengths(input_ids, attention_mask)
    if lengths is None:
        return None
    rows = input_ids.detach().to("cpu").tolist()
    return token_trie_of_rows([row[:length] for row, length in zip(rows, lengths)])


def token_trie_of_rows(rows: Sequence[Sequence[int]]) -> TokenTrie:
    """The :class:`TokenTrie` of rows given as host token lists (no padding)."""
    children: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    positions: list[int] = []
    paths: list[list[int]] = []
    for row in rows:
        node, path = -1, []
        for position, token in enumerate(row):
            child = children.get((node, token))
            if child is None:
                child = children[(node, token)] = len(tokens)
                tokens.append(token)
                positions.append(position)
            path.append(child)
            node = child
        paths.append(path)
    return TokenTrie(tokens, positions, paths)


def packed_prefix_trie(
    model_config: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    *,
    row_tokens: Sequence[Sequence[int]] | None = None,
) -> TokenTrie | None:
    """The trie to run :func:`packed_prefix_forward` on, or None where that forward does not
    apply or saves nothing: an attention without explicit masks, a sliding window shorter
    than the rows, rows not right-padded, no fewer distinct tokens than the padded batch,
    or more than :func:`packed_max_tokens`. ``row_tokens``: as in :func:`prefix_tree`."""
    if getattr(model_config, "_attn_implementation", None) not in _MASKED_ATTENTION:
        return None
    window = getattr(model_config, "sliding_window", None)
    if window is not None and window < input_ids.shape[1]:
        return None
    if row_tokens is None:
        trie = token_trie(input_ids, attention_mask)
    else:
        trie = token_trie_of_rows(row_tokens)
    if (
        trie is None
        or not 0 < len(trie) < input_ids.numel()
        or len(trie) > packed_max_tokens(input_ids.device)
    ):
        return None
    return trie


def packed_max_tokens(device: Any) -> int:
    """The most distinct tokens :func:`packed_prefix_forward` takes on ``device``."""
    if torch.device(device).type == "cpu":
        return min(PACKED_MAX_TOKENS, PACKED_MAX_TOKENS_CPU)
    return PACKED_MAX_TOKENS


def packed_prefix_forward(
    body: Any, trie: TokenTrie, shape: tuple[int, int], *, device: Any, additive: bool = False
) -> Tensor:
    """(B, T, H) last hidden states of ``body`` over rows of ``shape`` from ONE forward of
    the trie's N tokens (each at its depth, each attending to its ancestors and itself).

    Padding positions get zero hidden states (no loss reads them). Gradients reach a shared
    token summed over the rows that hold it, as in the row-by-row forward. ``additive``:
    give the mask as 0 / dtype-min floats (eager attention) instead of booleans (SDPA).
    """
    from composer_replication.samples.wire import to_device

    n_rows, width = shape
    n_tokens = len(trie)
    # The mask and every index are built on the host from the trie's lists and copied once,
    # without blocking: a tensor made from a list right on a GPU waits for the device.
    host = {"dtype": torch.long, "device": "cpu"}
    allowed = torch.zeros((n_tokens, n_tokens), dtype=torch.bool, device="cpu")
    for path in trie.paths:
        if path:
            nodes = torch.tensor(path, **host)
            ancestry = torch.ones((len(path), len(path)), dtype=torch.bool, device="cpu")
            allowed[nodes[:, None], nodes[None, :]] = ancestry.tril()
    allowed = to_device(allowed, device)
    # row r, position p reads node paths[r][p]; padding reads an appended zero row
    where = [path + [n_tokens] * (width - len(path)) for path in trie.paths]
    index = to_device(torch.tensor(where, **host).reshape(n_rows, width), device)
    tokens = to_device(torch.tensor([trie.tokens], **host), device)
    positions = to_device(torch.tensor([trie.positions], **host), device)
    mask: Tensor = allowed
    if additive:
        dtype = body.get_input_embeddings().weight.dtype
        mask = torch.zeros((n_tokens, n_tokens), dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    out = body(
        input_ids=tokens,
        attention_mask=mask[None, None],
        position_ids=positions,
        use_cache=False,
    )
    hidden = out.last_hidden_state[0]
    return torch.cat([hidden, hidden.new_zeros(1, hidden.shape[-1])])[index]
