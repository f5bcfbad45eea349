"""Batched in-process sampling with the live policy.

The decode loop is :mod:`.decode` (distinct prompts prefilled once, finished rows leave the
batch, a preallocated KV cache) with the linear layers on packed oneDNN weights on a CPU
(:mod:`.packed_linear`). Sampling uses plain temperature (no top-k / top-p), so the
sampler's distribution is exactly ``softmax(logits / temperature)`` and the log-probs
returned here are the ones the trainer's importance ratio compares against. ``temperature=0`` is greedy decoding (its
log-probs are then reported at temperature 1). A LoRA policy samples with its adapters
merged into the base weights (:func:`~composer_replication.model.parts.lora_merged`), as an
inference engine would; the base weights are restored exactly afterwards.

Two decode loops sample in process (:class:`DecodeOptions`, handed to :func:`generate` and
carried by :class:`InProcessSampler`): the general one above, and on a GPU the static one
(:mod:`.static_decode`: the batch stays on the device, the host reads it once every
``sync_every`` tokens, each step is one CUDA graph).

Each completion ends at the first EOS (kept), at the end of the first stop string (kept,
tokens after it dropped), or at ``max_new_tokens``.

Inside :func:`reuse_prompt_states` a prompt is prefilled once however many calls sample
it. Inside :func:`seeded_rows` each row draws its random numbers from its own generator, seeded
from the context's seed, the row's prompt and its occurrence among equal prompts of the
call: a task's group samples the same completions whichever batch (or data-parallel rank)
it is sampled in. Outside it, rows draw from torch's global generator. Both are context
variables because they scope one collection (a step's batch, an evaluation) across the
environments that sample it, not a setting of the sampler: the decode options, which are,
travel with the sampler instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from composer_replication.samples.generation import Generation, SamplingSettings
from composer_replication.samples.padding import pad_id_of


@dataclass(frozen=True)
class DecodeOptions:
    """Which in-process decode loop samples, and how (the ``[inference]`` settings of the
    same names): ``loop`` 'auto' | 'static' | 'general', ``sync_every`` (static loop: steps
    between host reads), ``compile`` (static loop: torch.compile the step), ``cuda_graphs``
    (static loop on a GPU: one captured graph per step shape), ``dtype`` (the
    ``sampling_dtype``: the matrix products' precision while sampling, see
    :func:`sampling_compute_dtype`)."""

    loop: str = "auto"
    sync_every: int = 16
    compile: bool = False
    cuda_graphs: bool = True
    dtype: str = "auto"

    @classmethod
    def of(cls, inference: Any) -> DecodeOptions:
        """The options an in-process ``[inference]`` config sets."""
        return cls(
            loop=inference.decode_loop,
            sync_every=inference.sync_every,
            compile=inference.compile_decode,
            cuda_graphs=inference.cuda_graphs,
            dtype=inference.sampling_dtype,
        )


def sampling_compute_dtype(options: DecodeOptions, device: Any) -> Any:
    """The dtype of the matrix products while sampling on ``device`` (None: the weights'
    own). Inside :func:`evaluation_precision` its setting decides; otherwise ``options.dtype``:
    ``"float32"``: the weights' own; ``"bfloat16"``: bfloat16; ``"auto"``: the caller's
    autocast dtype (the trainer's forward and the sampler compute alike: bfloat16 on a GPU
    and on a CPU that computes it), the weights' own outside autocast."""
    import torch

    chosen = _EVALUATION_DTYPE.get()
    if chosen == "auto":  # held-out answers: float32 on a CPU, the rollouts' precision else
        chosen = "float32" if device.type == "cpu" else None
    dtype = chosen or options.dtype
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype == "float32":
        return None
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


_EVALUATION_DTYPE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "evaluation_dtype", default=None
)


@contextlib.contextmanager
def evaluation_precision(dtype: str) -> Iterator[None]:
    """In-process sampling in the block computes in ``dtype`` (``[eval] sampling_dtype``:
    'auto', 'float32' or 'bfloat16'; see :func:`sampling_compute_dtype`), whatever the
    sampler's own decode options say: held-out answers are measured with one instrument."""
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"evaluation sampling dtype {dtype!r}: use auto, float32 or bfloat16")
    token = _EVALUATION_DTYPE.set(dtype)
    try:
        yield
    finally:
        _EVALUATION_DTYPE.reset(token)


_ROW_SEED: contextvars.ContextVar[int | None] = contextvars.ContextVar("row_seed", default=None)
_PROMPT_STATES: contextvars.ContextVar[Any] = contextvars.ContextVar("prompt_states", default=None)


@contextlib.contextmanager
def seeded_rows(seed: int) -> Iterator[None]:
    """In-process sampling in the block draws each row's randomness from its own generator
    (see the module docstring)."""
    token = _ROW_SEED.set(int(seed))
    try:
        yield
    finally:
        _ROW_SEED.reset(token)


def static_loop_applies(model: Any, options: DecodeOptions) -> bool:
    """Whether ``options`` send ``model``'s sampling through the static loop ('static' on a
    model it cannot run is an error naming why)."""
    from composer_replication.inference.decoding.static_decode import static_decoding_supported

    if options.loop == "general":
        return False
    why = static_decoding_supported(model)
    if options.loop == "static":
        if why is not None:
            raise ValueError(f"inference.decode_loop = 'static' cannot decode this model: {why}")
        return True
    return why is None and next(model.parameters()).device.type == "cuda"


@contextlib.contextmanager
def reuse_prompt_states(*, outer: bool = False, keep_finished: bool = False) -> Iterator[Any]:
    """In-process sampling in the block prefills each distinct prompt once: its state is
    kept and later calls start from it, and a prompt that extends a kept one (an agent's
    next turn) prefills only its new tokens. Only while the policy's weights stay as they
    are (an evaluation, one collection of episodes); yields the
    :class:`~composer_replication.inference.decoding.kv_cache.PromptStates`. ``outer``: inside another
    such block, keep using its store. ``keep_finished``: the store keeps finished rows'
    states for the next turns and no second copy of the rows decoding (agent episodes;
    ``PromptStates.keep_finished``), for the length of the block."""
    from composer_replication.inference.decoding.kv_cache import PromptStates

    current = _PROMPT_STATES.get()
    if outer and current is not None:
        before = current.keep_finished
        current.keep_finished = before or keep_finished
        try:
            yield current
        finally:
            current.keep_finished = before
        return
    states = PromptStates(keep_finished=keep_finished)
    token = _PROMPT_STATES.set(states)
    try:
        yield states
    finally:
        _PROMPT_STATES.reset(token)


def derived_seed(*parts: Any) -> int:
    """A 63-bit seed that depends on ``parts`` only (stable across processes and runs)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def row_seeds(seed: int, prompts: Sequence[Sequence[int]]) -> list[int]:
    """One seed per prompt from ``seed``, the prompt's tokens and its occurrence among equal
    prompts before it (the k-th sample of a group)."""
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for prompt in prompts:
        key = tuple(int(t) for t in prompt)
        k = seen.get(key, 0)
        seen[key] = k + 1
        out.append(derived_seed(int(seed), key, k))
    return out


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    settings: SamplingSettings | None = None,
    *,
    decode: DecodeOptions | None = None,
    generator_seed: int | None = None,
    max_rows: int | None = None,
    on_row_done: Callable[[int, Generation], None] | None = None,
    loops: Counter[str] | None = None,
) -> list[Generation]:
    """Sample one completion per prompt with ``model`` (a torch model in this process), in
    one batched call, with the decode loop ``decode`` chooses (None: the default options).
    A sampler of another kind is called through its own ``sample_batch``
    (:class:`~composer_replication.roles.Sampler`); :class:`InProcessSampler` is this
    function in that shape.

    ``max_rows``: in process, at most this many rows decode at once and the others join as
    rows finish (None: all at once). ``on_row_done(index, generation)`` is called once per
    prompt as soon as its completion is known: while the rest of the batch still decodes
    in the static loop, after the call otherwise (a grader can start on it at once).
    ``loops``: the loop that ran ('static' or 'general') is counted in it."""
    import torch

    settings = settings or SamplingSettings()
    pad_id = pad_id_of(tokenizer)
    eos_ids = _eos_ids(model, tokenizer)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if generator_seed is not None:
        torch.manual_seed(generator_seed)
    context_seed = _ROW_SEED.get()
    from composer_replication.model.parts import lora_merged

    common = {
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "eos_ids": eos_ids,
        "tokenizer": tokenizer,
        "stop_strings": settings.stop_strings,
        "row_seeds": None if context_seed is None else row_seeds(context_seed, prompts),
        "max_rows": max_rows,
    }
    was_training = model.training
    model.eval()
    try:
        options = decode or DecodeOptions()
        device = next(model.parameters()).device
        # the static loop decodes merged LoRA weights; the CPU's packed path folds them itself
        maybe_static = options.loop == "static" or (
            options.loop == "auto" and device.type == "cuda"
        )
        with torch.no_grad(), lora_merged(model) if maybe_static else contextlib.nullcontext():
            static = maybe_static and static_loop_applies(model, options)
            if loops is not None:
                loops["static" if static else "general"] += 1
            if static:
                done = None
                if on_row_done is not None:

                    def done(index: int, row: Any) -> None:
                        on_row_done(index, _generation(prompts[index], row, tokenizer))

                rows = _static_rows(model, prompts, options, {**common, "on_row_done": done})
                on_row_done = None  # every row was announced as it finished
            else:
                from composer_replication.inference.decoding.decode import decode_rows
                from composer_replication.inference.decoding.packed_linear import (
                    packed_linear_available,
                    packed_linears,
                )

                hint = min(len(prompts), max_rows or len(prompts))
                compute_dtype = sampling_compute_dtype(options, device)
                # on a CPU the sampler computes in its own precision, never the learner's
                cpu_own_precision = (
                    torch.autocast("cpu", enabled=False)
                    if device.type == "cpu"
                    else contextlib.nullcontext()
                )
                # packed weights fold LoRA adapters in themselves: no merge, no saved copy
                adapters_in = maybe_static or packed_linear_available(model, compute_dtype)
                with (
                    contextlib.nullcontext() if adapters_in else lora_merged(model),
                    cpu_own_precision,
                    packed_linears(model, batch_hint=hint, dtype=compute_dtype, fold_lora=True),
                ):
                    rows = decode_rows(
                        model,
                        prompts,
                        pad_id=pad_id,
                        prompt_states=_PROMPT_STATES.get(),
                        **common,
                    )
    finally:
        model.train(was_training)
    return announced(
        [_generation(prompt, row, tokenizer) for prompt, row in zip(prompts, rows)], on_row_done
    )


class InProcessSampler:
    """The :class:`~composer_replication.roles.Sampler` of a model in this process:
    :func:`generate` with ``model``.

    ``live``: the model is the policy being trained (False: a frozen local model, e.g. an
    sft source given by ``local_path``). The sampled log-probs are always the model's own.
    ``decode``: the decode loop and its settings (``[inference]``'s, for the policy).
    ``decode_loops`` counts the calls each loop ran ('static' / 'general').
    """

    def __init__(
        self, model: Any, *, live: bool = True, decode: DecodeOptions | None = None
    ) -> None:
        self.model = model
        self.samples_from_live_policy = live
        self.decode = decode or DecodeOptions()
        self.decode_loops: Counter[str] = Counter()

    def sample_batch(
        self,
        tokenizer: Any,
        prompts: Sequence[Sequence[int]],
        settings: SamplingSettings,
        *,
        max_rows: int | None = None,
        on_row_done: Callable[[int, Generation], None] | None = None,
    ) -> list[Generation]:
        return generate(
            self.model,
            tokenizer,
            prompts,
            settings,
            decode=self.decode,
            max_rows=max_rows,
            on_row_done=on_row_done,
            loops=self.decode_loops,
        )

    def __repr__(self) -> str:
        kind = "live" if self.samples_from_live_policy else "frozen"
        return f"InProcessSampler({type(self.model).__name__}, {kind})"


def _generation(prompt: Sequence[int], row: Any, tokenizer: Any) -> Generation:
    return Generation(
        prompt_ids=list(prompt),
        completion_ids=row.tokens,
        logprobs=row.logprobs,
        finish_reason=row.finish_reason,
        text=tokenizer.decode(row.tokens, skip_special_tokens=True),
    )


def announced(
    generations: list[Generation], on_row_done: Callable[[int, Generation], None] | None
) -> list[Generation]:
    """``generations``, after ``on_row_done(index, generation)`` for each (for samplers
    that learn every completion at once)."""
    if on_row_done is not None:
        for index, generation in enumerate(generations):
            on_row_done(index, generation)
    return generations


def _static_rows(
    model: Any, prompts: Sequence[Sequence[int]], options: DecodeOptions, common: dict
) -> list[Any]:
    """The static loop's rows; its matrix products run in the sampling dtype
    (:func:`sampling_compute_dtype`: under a GPU's autocast, the autocast dtype, as the
    trainer's forward does), with autocast itself off inside."""
    import torch

    from composer_replication.inference.decoding.static_decode import static_decode_rows

    device = next(model.parameters()).device
    compute_dtype = sampling_compute_dtype(options, device)
    with torch.autocast(device.type, enabled=False):
        return static_decode_rows(
            model,
            prompts,
            compute_dtype=compute_dtype,
            compile=options.compile,
            graphs=options.cuda_graphs and device.type == "cuda",
            sync_every=options.sync_every,
            **common,
        )


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("neither the model nor the tokenizer defines an eos token id")
    return sorted(ids)
