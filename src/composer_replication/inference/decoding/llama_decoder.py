"""A Llama-family forward over a static KV cache, written out for the decode loop.

The static decode loop (:mod:`.static_decode`) needs a forward whose every tensor has a
shape fixed by the batch bucket, that writes its keys and values in place at a column
given by a device tensor, and that never asks the host for a value: then one decode step is
one CUDA graph (or one compiled graph) whatever the token. Written against the module's
own weights rather than through the library's cache classes, it does not depend on how
any version of those classes lays out its state.

It covers the decoder-only models built from the Llama blocks (``llama``, ``mistral``
without a sliding window, ``qwen2`` with its query/key/value biases, ``smollm3`` without
its no-rope layers): RMSNorm, rotary position embeddings read from the model's own rotary
module (so every rope scaling with a fixed frequency table is the model's), grouped-query
attention, a SiLU-gated MLP, an LM head tied or not. :func:`supports` says whether a model
is one of them; the loop falls back to the general one otherwise.

Precision follows the trainer's mixed precision: the residual stream and the norms stay
in the master dtype, the matrix products (and the KV cache) run in ``compute_dtype``. With
``compute_dtype`` equal to the master dtype the forward is the library's forward, op for
op (tests compare the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "BlockKernels",
    "DecoderWeights",
    "attention_inputs",
    "block_output",
    "decode_forward",
    "prefill_forward",
    "supports",
]

_ARCHITECTURES = {"llama", "mistral", "qwen2"}


def _text_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        return None
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def _body(model: Any) -> Any:
    """The Hugging Face ``*ForCausalLM`` under a PEFT wrapper (or the model itself)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base


def supports(model: Any) -> str | None:
    """None when :class:`DecoderWeights` can run ``model``, else why it cannot."""
    config = _text_config(model)
    kind = getattr(config, "model_type", None)
    if kind not in _ARCHITECTURES:
        return f"model type {kind!r} is not one of {sorted(_ARCHITECTURES)}"
    # qwen2 configs name a window they do not use unless use_sliding_window is set
    windowed = getattr(config, "use_sliding_window", kind != "qwen2")
    if getattr(config, "sliding_window", None) and windowed:
        return "the model attends through a sliding window"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if getattr(config, "mlp_bias", False):
        return "the MLP has biases"
    body = _body(model)
    inner = getattr(body, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        return "no rotary embedding module with a fixed frequency table"
    if getattr(rotary, "rope_type", "default") == "dynamic":
        return "dynamic rope scaling changes the frequencies with the length"
    for module in body.modules():
        if hasattr(module, "lora_A") and not getattr(module, "merged", True) and module.lora_A:
            return "the model has unmerged LoRA adapters (sample inside lora_merged)"
    if any(type(p).__name__ == "DTensor" for p in body.parameters()):
        return "the model's parameters are sharded"
    return None


def _weight(module: Any) -> torch.Tensor:
    return getattr(module, "base_layer", module).weight.detach()


def _bias(module: Any) -> torch.Tensor | None:
    bias = getattr(getattr(module, "base_layer", module), "bias", None)
    return None if bias is None else bias.detach()


@dataclass
class _Layer:
    qkv: torch.Tensor  # (q + 2 kv, hidden): one product for the three projections
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor  # (2 intermediate, hidden)
    down: torch.Tensor
    norm_in: torch.Tensor
    norm_post: torch.Tensor


class DecoderWeights:
    """The weights of a supported model laid out for decoding.

    The three attention projections are concatenated into one matrix, and so are the MLP's
    gate and up projections (two products per block instead of five). Matrices are held in
    ``compute_dtype``, norms and embeddings in the model's dtype. :meth:`refresh` copies a
    model's current weights into the same storage (a captured graph keeps reading them).
    """

    def __init__(self, model: Any, compute_dtype: torch.dtype) -> None:
        why = supports(model)
        if why is not None:
            raise ValueError(f"the static decoder cannot run this model: {why}")
        config = _text_config(model)
        self.compute_dtype = compute_dtype
        self.n_heads = int(config.num_attention_heads)
        self.n_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.n_heads)
        self.eps = float(config.rms_norm_eps)
        self.n_layers = int(config.num_hidden_layers)
        self.vocab = int(config.vocab_size)
        self.layers: list[_Layer] = []
        self.refresh(model)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def refresh(self, model: Any) -> None:
        """Take ``model``'s current weights (in place after the first call)."""
        body = _body(model)
        inner = body.model
        rotary = inner.rotary_emb
        head = body.get_output_embeddings().weight.detach()
        fresh = {
            "embed": inner.embed_tokens.weight.detach(),
            "norm": inner.norm.weight.detach(),
            "head": head.to(self.compute_dtype),
            "inv_freq": rotary.inv_freq.detach().float(),
        }
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        layers = []
        for block in inner.layers:
            attn, mlp = block.self_attn, block.mlp
            biases = [_bias(attn.q_proj), _bias(attn.k_proj), _bias(attn.v_proj)]
            layers.append(
                _Layer(
                    qkv=torch.cat(
                        [_weight(attn.q_proj), _weight(attn.k_proj), _weight(attn.v_proj)]
                    ).to(self.compute_dtype),
                    qkv_bias=None
                    if biases[0] is None
                    else torch.cat(biases).to(self.compute_dtype),
                    o=_weight(attn.o_proj).to(self.compute_dtype),
                    gate_up=torch.cat([_weight(mlp.gate_proj), _weight(mlp.up_proj)]).to(
                        self.compute_dtype
                    ),
                    down=_weight(mlp.down_proj).to(self.compute_dtype),
                    norm_in=block.input_layernorm.weight.detach(),
                    norm_post=block.post_attention_layernorm.weight.detach(),
                )
            )
        if not self.layers:
            for name, value in fresh.items():
                setattr(self, name, value.clone())
            self.layers = [
                _Layer(**{k: None if v is None else v.clone() for k, v in vars(layer).items()})
                for layer in layers
            ]
            return
        with torch.no_grad():
            for name, value in fresh.items():
                getattr(self, name).copy_(value)
            for mine, theirs in zip(self.layers, layers):
                for key, value in vars(theirs).items():
                    if value is not None:
                        getattr(mine, key).copy_(value)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the forward reads (for marking them as static inputs)."""
        out = [self.embed, self.norm, self.head, self.inv_freq]
        for layer in self.layers:
            out += [t for t in vars(layer).values() if t is not None]
        return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(w: DecoderWeights, positions: torch.Tensor, dtype: torch.dtype) -> tuple[Any, Any]:
    """cos, sin of shape (*positions.shape, head_dim) in ``dtype``."""
    freqs = positions.float()[..., None] * w.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * w.rope_scale).to(dtype), (emb.sin() * w.rope_scale).to(dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
    return F.linear(x.to(weight.dtype), weight, bias)


def _qkv(w: DecoderWeights, layer: _Layer, h: torch.Tensor) -> tuple[Any, Any, Any]:
    """Query, key and value of ``h`` (rows, T, hidden) as (rows, heads, T, dim)."""
    rows, length = h.shape[:2]
    q_width = w.n_heads * w.head_dim
    kv_width = w.n_kv_heads * w.head_dim
    qkv = _linear(h, layer.qkv, layer.qkv_bias)
    q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
    q = q.view(rows, length, w.n_heads, w.head_dim).transpose(1, 2)
    k = k.view(rows, length, w.n_kv_heads, w.head_dim).transpose(1, 2)
    v = v.view(rows, length, w.n_kv_heads, w.head_dim).transpose(1, 2)
    return q, k, v


def _mlp(layer: _Layer, h: torch.Tensor) -> torch.Tensor:
    gate, up = _linear(h, layer.gate_up).chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, layer.down)


def prefill_forward(
    w: DecoderWeights,
    ids: torch.Tensor,
    valid: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """Prompts ``ids`` (rows, T), left-padded (``valid`` False on padding): fills
    ``keys`` / ``values`` (layers, rows, kv_heads, T, dim) and returns the float32 logits of
    each row's last position (rows, vocab)."""
    rows, length = ids.shape
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    cos, sin = _rope(w, positions, w.compute_dtype)
    cos, sin = cos[:, None], sin[:, None]
    causal = torch.ones((length, length), dtype=torch.bool, device=ids.device).tril()
    # a padded query attends to itself only (its output is never used, but stays finite)
    allowed = (causal & valid[:, None, None, :]) | torch.eye(
        length, dtype=torch.bool, device=ids.device
    )
    group = w.n_heads // w.n_kv_heads
    x = w.embed[ids]
    for index, layer in enumerate(w.layers):
        h = _rms_norm(x, layer.norm_in, w.eps)
        q, k, v = _qkv(w, layer, h)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys[index].copy_(k)
        values[index].copy_(v)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=w.head_dim**-0.5)
        x = x + _linear(a.transpose(1, 2).reshape(rows, length, -1), layer.o)
        x = x + _mlp(layer, _rms_norm(x, layer.norm_post, w.eps))
    last = _rms_norm(x[:, -1], w.norm, w.eps)
    return _linear(last, w.head).float()


def attention_inputs(
    x: torch.Tensor,
    norm: torch.Tensor,
    qkv: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    n_heads: int,
    n_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's attention inputs for one token per row: ``x`` (rows, 1, hidden) normed and
    projected; the query (rows, kv_heads, group, dim) with its group's heads as the query
    positions of their key/value head, the key and value (rows, kv_heads, 1, dim); the
    rotary embedding applied to query and key."""
    rows = x.shape[0]
    dim = qkv.shape[0] // (n_heads + 2 * n_kv_heads)
    h = _rms_norm(x, norm, eps)
    q, k, v = _linear(h, qkv, qkv_bias).split(
        [n_heads * dim, n_kv_heads * dim, n_kv_heads * dim], dim=-1
    )
    q = q.view(rows, n_heads, 1, dim)
    k = k.view(rows, n_kv_heads, 1, dim)
    v = v.view(rows, n_kv_heads, 1, dim)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q.reshape(rows, n_kv_heads, n_heads // n_kv_heads, dim), k, v


def block_output(
    x: torch.Tensor,
    attended: torch.Tensor,
    o: torch.Tensor,
    norm_post: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The rest of a block after attention: output projection, residual, the MLP."""
    x = x + _linear(attended.reshape(x.shape[0], 1, -1), o)
    gate, up = _linear(_rms_norm(x, norm_post, eps), gate_up).chunk(2, dim=-1)
    return x + _linear(F.silu(gate) * up, down)


@dataclass(frozen=True)
class BlockKernels:
    """The two pieces of a decode block that hold no cache write (so they compile into
    fused kernels with nothing to copy back); the cache write and the attention between
    them run as they are."""

    attention_inputs: Any = attention_inputs
    block_output: Any = block_output


def decode_forward(
    w: DecoderWeights,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    column: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    kernels: BlockKernels = BlockKernels(),
) -> torch.Tensor:
    """One token per row: ``tokens`` (rows,) at ``positions`` (rows,) write their keys and
    values at cache column ``column`` (a 1-element long tensor) of ``keys`` / ``values``
    (layers, rows, kv_heads, width, dim) and attend to the columns where ``valid`` (rows,
    width) is True (the written column included). Returns float32 logits (rows, vocab).

    The query heads that share a key/value head are laid out as that head's queries, so
    grouped-query attention reads each cached key once. ``kernels``: the block pieces to
    use (compiled ones, say).
    """
    cos, sin = _rope(w, positions[:, None], w.compute_dtype)
    cos, sin = cos[:, None], sin[:, None]  # (rows, 1, 1, dim)
    mask = valid[:, None, None, :]
    x = w.embed[tokens][:, None]  # (rows, 1, hidden)
    for index, layer in enumerate(w.layers):
        q, k, v = kernels.attention_inputs(
            x, layer.norm_in, layer.qkv, layer.qkv_bias, cos, sin, w.eps, w.n_heads, w.n_kv_heads
        )
        keys[index].index_copy_(2, column, k)
        values[index].index_copy_(2, column, v)
        attended = F.scaled_dot_product_attention(
            q, keys[index], values[index], attn_mask=mask, scale=w.head_dim**-0.5
        )
        x = kernels.block_output(
            x, attended, layer.o, layer.norm_post, layer.gate_up, layer.down, w.eps
        )
    return _linear(_rms_norm(x[:, 0], w.norm, w.eps), w.head).float()
