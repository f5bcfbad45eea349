"""A pre-flight estimate of the learner's peak GPU memory, from the model's shape alone.

``train`` loads nothing before it checks a config; this module says, from the numbers in a
model's ``config.json`` and the run's settings, how much memory one optimizer step needs at
its peak (the backward of the largest micro-batch), so a config that cannot fit the GPU is
refused in one line before minutes of loading and sampling.

What it counts, in bytes (each term is a field of :class:`LearnerMemory`):

- the policy's parameters at their dtype, the trainable ones' gradients and AdamW's two
  moments (same dtype as the parameter), and autocast's low-precision copy of the weights
  (a mixed-precision run casts each weight once per forward);
- frozen copies the run keeps (the initial policy of a full fine-tune: reference and KL);
- saved activations of one micro-batch: ``micro_batch_tokens`` tokens (teacher context and
  preference pair rows included: :func:`~composer_replication.samples.wire.pack_samples` counts
  them against the same budget) times the bytes one token keeps per decoder layer
  (:func:`layer_bytes_per_token`), or, with gradient checkpointing, each layer's input
  plus one layer's full set (recomputed in the backward);
- the chunked LM head's workspace: ``chunk_size`` rows of float32 logits and their
  gradient (:mod:`composer_replication.ops.head`).

It does not count the CUDA context, allocator fragmentation or decode buffers (released
before the learner runs): :func:`fits` keeps a reserve (10% by default) for those. The
per-layer count follows the saved-activation accounting of Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models" (arXiv 2205.05198), for a Llama block
(RMSNorm, GQA with a fused SDPA kernel that saves no attention matrix, SwiGLU MLP).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "DEFAULT_RESERVE",
    "EMBEDDED_SHAPE",
    "LearnerMemory",
    "ModelShape",
    "estimate_learner_memory",
    "fits",
    "largest_fitting_tokens",
    "layer_bytes_per_token",
]

#: Share of the GPU's memory kept free for what the estimate does not count.
DEFAULT_RESERVE = 0.10
GIB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama-family ``config.json`` the estimate needs."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = True

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> ModelShape:
        """From a ``config.json`` dict or a ``PretrainedConfig``; a missing number is a
        one-line ``ValueError`` naming it (``num_key_value_heads`` defaults to the heads)."""

        def get(name: str, default: Any = None) -> Any:
            value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
            if value is None and default is None:
                raise ValueError(
                    f"model config has no {name!r}: the memory estimate needs a Llama-family "
                    "config (hidden_size, num_hidden_layers, intermediate_size, heads, vocab)"
                )
            return default if value is None else value

        heads = int(get("num_attention_heads"))
        return cls(
            hidden_size=int(get("hidden_size")),
            num_hidden_layers=int(get("num_hidden_layers")),
            intermediate_size=int(get("intermediate_size")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", heads)),
            vocab_size=int(get("vocab_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", True)),
        )

    @property
    def kv_size(self) -> int:
        """Width of the keys (and of the values): kv heads x head dim."""
        return self.num_key_value_heads * (self.hidden_size // self.num_attention_heads)

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear of one decoder layer, by module name."""
        h, kv, i = self.hidden_size, self.kv_size, self.intermediate_size
        return {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def n_parameters(self) -> int:
        """Every parameter: embeddings (and an untied head), the layers' linears and
        RMSNorm weights, the final norm."""
        h = self.hidden_size
        per_layer = sum(a * b for a, b in self.module_shapes().values()) + 2 * h
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * h + self.num_hidden_layers * per_layer + h

    def n_lora_parameters(self, r: int, target_modules: Sequence[str]) -> int:
        """Adapter parameters of rank ``r`` on ``target_modules`` (A: r x in, B: out x r)."""
        shapes = self.module_shapes()
        per_layer = sum(r * sum(shapes[m]) for m in target_modules if m in shapes)
        return self.num_hidden_layers * per_layer


#: SmolLM2-135M-Instruct, the embedded model (its config.json; 134,515,008 parameters).
EMBEDDED_SHAPE = ModelShape(
    hidden_size=576,
    num_hidden_layers=30,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
)


def layer_bytes_per_token(shape: ModelShape, *, param_bytes: int, compute_bytes: int) -> int:
    """Bytes one token's activations keep for the backward in one decoder layer.

    ``param_bytes``: the residual stream's and the norms' element size (the parameters'
    dtype); ``compute_bytes``: the matrix products' (autocast's dtype, else the same).
    With h = hidden, k = key/value width, i = intermediate, p / c those sizes:

    - two RMSNorms, each its input and its normalised output: ``4 p h``;
    - under autocast, each of q, k, v, gate and up projections saves its own cast of its
      input: ``5 c h`` (none without autocast: they share the norm's output);
    - attention (SDPA saves q, k, v, its output; o_proj its contiguous input): ``3 c h +
      2 c k``;
    - SwiGLU (gate and up outputs, SiLU's output, their product): ``4 c i``.
    """
    h, k, i = shape.hidden_size, shape.kv_size, shape.intermediate_size
    p, c = param_bytes, compute_bytes
    casts = 5 * c * h if p != c else 0
    return 4 * p * h + casts + 3 * c * h + 2 * c * k + 4 * c * i


@dataclass(frozen=True)
class LearnerMemory:
    """The estimate's terms, in bytes (see the module docstring); ``total`` is their sum."""

    parameters: int
    gradients: int
    optimizer: int
    weight_casts: int
    frozen_copies: int
    activations: int
    head: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def describe(self) -> str:
        """One line: each term and the total, in GiB."""
        parts = [f"{f.name} {getattr(self, f.name) / GIB:.2f}" for f in fields(self)]
        return f"{self.total / GIB:.2f} GiB ({', '.join(parts)})"


def estimate_learner_memory(
    shape: ModelShape,
    *,
    micro_batch_tokens: int,
    param_bytes: int = 4,
    compute_bytes: int = 2,
    lora_r: int | None = None,
    lora_targets: Sequence[str] = (),
    gradient_checkpointing: bool = False,
    chunk_size: int | None = None,
    frozen_copies: int = 1,
    shards: int = 1,
) -> LearnerMemory:
    """Peak learner memory of one optimizer step (bytes, per term).

    Args:
        shape: the model's numbers.
        micro_batch_tokens: tokens of the largest micro-batch (student, teacher context and
            pair rows, padded, as ``pack_samples`` counts them).
        param_bytes / compute_bytes: element size of the parameters and of the matrix
            products (4 / 2: float32 master weights under bfloat16 autocast).
        lora_r / lora_targets: LoRA's rank and target modules (None: a full fine-tune).
        gradient_checkpointing: recompute each layer's activations in the backward.
        chunk_size: token rows per LM-head chunk (None: the whole micro-batch at once).
        frozen_copies: full copies of the weights kept frozen (the initial policy of a
            full fine-tune; 0 for LoRA, whose reference is the adapter-free base).
        shards: data-parallel ranks that shard the parameters, gradients, optimizer state
            and frozen copies (FSDP2); the activations are each rank's own.
    """
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens={micro_batch_tokens} must be >= 1")
    if shards < 1:
        raise ValueError(f"shards={shards} must be >= 1")
    n = shape.n_parameters
    trainable = n if lora_r is None else shape.n_lora_parameters(lora_r, lora_targets)
    total_params = n if lora_r is None else n + trainable
    per_layer = layer_bytes_per_token(shape, param_bytes=param_bytes, compute_bytes=compute_bytes)
    h, layers = shape.hidden_size, shape.num_hidden_layers
    # with checkpointing: each layer's input, and one layer's set while it is recomputed
    kept = layers * param_bytes * h + per_layer if gradient_checkpointing else layers * per_layer
    kept += 3 * param_bytes * h  # the embeddings' output, the final norm's input and output
    rows = micro_batch_tokens if not chunk_size else min(chunk_size, micro_batch_tokens)
    return LearnerMemory(
        parameters=total_params * param_bytes // shards,
        gradients=trainable * param_bytes // shards,
        optimizer=2 * trainable * param_bytes // shards,
        weight_casts=total_params * compute_bytes // shards if compute_bytes != param_bytes else 0,
        frozen_copies=frozen_copies * n * param_bytes // shards,
        activations=micro_batch_tokens * kept,
        head=2 * rows * shape.vocab_size * 4,  # float32 logits and their gradient
    )


def fits(memory: LearnerMemory, available: int, reserve: float = DEFAULT_RESERVE) -> bool:
    """Whether ``memory`` fits ``available`` bytes with ``reserve`` of them kept free."""
    return memory.total <= (1.0 - reserve) * available


def largest_fitting_tokens(
    shape: ModelShape, available: int, reserve: float = DEFAULT_RESERVE, **settings: Any
) -> int:
    """The largest ``micro_batch_tokens`` (a multiple of 1024; 0 when none does) whose
    estimate fits; ``settings`` are :func:`estimate_learner_memory`'s other arguments."""
    # past one head chunk every term but the activations is fixed: the total is linear
    base = max(int(settings.get("chunk_size") or 0), 1024)
    one = estimate_learner_memory(shape, micro_batch_tokens=base, **settings)
    two = estimate_learner_memory(shape, micro_batch_tokens=2 * base, **settings)
    per_token = (two.total - one.total) / base
    fixed = one.total - per_token * base
    room = (1.0 - reserve) * available - fixed
    return max(0, int(room / per_token) // 1024 * 1024)
