"""Device and precision: config validation, resolution, and proof that every tensor the
trainer, samplers, scorers, packer, ops and checkpoints create follows the model's device.

Two real mechanisms find a tensor created on the wrong device:

- ``torch.device("meta")`` as a context (torch's default-device function mode): inside it,
  a tensor created without an explicit ``device=`` lands on ``meta`` while the tiny model
  and its data stay on the CPU. In torch 2.13 an op mixing meta and CPU tensors raises,
  and a meta tensor cannot be copied back, so a stray tensor (one that would sit on the CPU
  next to a GPU model) fails the test. The model keeps real values, so paths with
  data-dependent control flow (sampling's ``.tolist()``, the head's row selection) run.
- :class:`SameDevice`, a ``TorchDispatchMode`` that asserts every op's tensor arguments
  share one device (explicit moves and 0-dim host scalars excepted), for ops such as
  in-place index writes that would otherwise copy across devices silently.

Paths without data-dependent control flow also run with every tensor on ``meta``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from composer_replication.config.run import ModelConfig
from composer_replication.model.devices import (
    Precision,
    autocast,
    module_device,
    resolve_device,
    resolve_precision,
)
from composer_replication.samples.wire import TrainingSample, pack_samples
from composer_replication.training.step import train_step

sys.path.insert(0, str(Path(__file__).parent / "training"))
from test_step import _jsd_sample, _pair, _rl_sample

# explicit moves between devices, and ops that only read metadata
_MOVES = {"aten::_to_copy", "aten::copy_", "aten::lift_fresh", "aten::_local_scalar_dense"}


class SameDevice(TorchDispatchMode):
    """Raise when an op's tensor arguments sit on different devices."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name not in _MOVES:
            tensors = [
                t
                for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")
            ]
            devices = {t.device for t in tensors}
            if len(devices) > 1:
                raise AssertionError(
                    f"{func._schema.name} mixes devices {sorted(map(str, devices))}"
                )
        return func(*args, **kwargs)


@contextlib.contextmanager
def _strays_fail():
    """Both checks at once (see the module docstring)."""
    with torch.device("meta"), SameDevice():
        yield


def _all_samples() -> list[TrainingSample]:
    ce = _rl_sample(4)
    ce.ce_weights = [0.5 * m for m in ce.loss_mask]
    ref = _rl_sample(5)
    ref.ref_kl_weights = list(ref.loss_mask)
    ref.ref_logprobs = [v - 0.1 for v in ref.inference_logprobs]
    return [_rl_sample(1), _jsd_sample(2), ce, ref, TrainingSample([], [], [], dpo=_pair(3))]


# --------------------------------------------------------------------------- config


def test_model_config_device_and_dtype_defaults_and_normalisation():
    cfg = ModelConfig()
    assert (cfg.device, cfg.dtype) == ("auto", "auto")
    assert ModelConfig(device="CPU").device == "cpu"
    assert ModelConfig(device="cuda:3").device == "cuda:3"
    for old in ("float32", "fp32", "bf16", "bfloat16", "float64", "torch.float16"):
        assert ModelConfig(dtype=old).dtype == old.removeprefix("torch.")


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "tpu", "cuda:0,1", "meta", ""])
def test_model_config_rejects_bad_device_naming_it(bad):
    with pytest.raises(ValidationError, match=r"'auto'.*'cpu'.*'cuda'") as err:
        ModelConfig(device=bad)
    assert repr(bad) in str(err.value)


def test_model_config_rejects_bad_dtype_naming_it():
    with pytest.raises(ValidationError, match=r"'int8' is unknown.*bfloat16"):
        ModelConfig(dtype="int8")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"'cuda:1' asks for a GPU.*'cpu'"):
            resolve_device("cuda:1")
    with pytest.raises(ValueError, match="'xpu'"):
        resolve_device("xpu")


def test_resolve_precision(monkeypatch):
    from composer_replication.model import devices

    cpu = torch.device("cpu")
    monkeypatch.setattr(devices, "cpu_bfloat16_kernels", lambda: None)
    assert resolve_precision("auto", cpu) == Precision(torch.float32, None)
    assert not resolve_precision("auto", cpu).mixed
    assert devices.precision_line(resolve_precision("auto", cpu), cpu) == "precision: float32"
    monkeypatch.setattr(devices, "cpu_bfloat16_kernels", lambda: "AVX512-BF16")
    mixed = resolve_precision("auto", cpu)
    assert mixed == Precision(torch.float32, torch.bfloat16)
    assert devices.precision_line(mixed, cpu) == (
        "precision: float32 weights, bfloat16 autocast (this CPU has AVX512-BF16; "
        "model.dtype = 'float32' turns it off)"
    )
    # an explicit dtype never autocasts, whatever the CPU computes
    assert resolve_precision("float32", cpu) == Precision(torch.float32, None)
    assert resolve_precision("bf16", cpu) == Precision(torch.bfloat16, None)
    assert resolve_precision("float64", cpu).param_dtype == torch.float64
    with pytest.raises(ValueError, match="'fp8' is unknown"):
        resolve_precision("fp8", cpu)


def test_the_cpu_reports_its_bfloat16_instructions_as_torch_does():
    from composer_replication.model.devices import cpu_bfloat16_kernels

    expected = (
        "AMX"
        if torch.cpu._is_amx_tile_supported()
        else "AVX512-BF16"
        if torch.cpu._is_avx512_bf16_supported()
        else None
    )
    assert cpu_bfloat16_kernels() == expected


def test_cpu_evaluation_keeps_float32_under_the_learners_autocast(tiny):
    """Held-out answers (``evaluation_precision("auto")``) do not follow the learner's
    bfloat16 autocast on a CPU: the same completions and log-probs as without it (float32
    is the instrument); rollouts follow it, like ``sampling_dtype = "bfloat16"``."""
    from composer_replication.inference.decoding.generate import (
        DecodeOptions,
        evaluation_precision,
        generate,
    )
    from composer_replication.model.devices import cpu_bfloat16_kernels
    from composer_replication.samples.generation import SamplingSettings

    model, tokenizer = tiny
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    settings = SamplingSettings(max_new_tokens=6, temperature=0.0)
    plain = generate(model, tokenizer, prompts, settings)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with evaluation_precision("auto"):
            held_out = generate(model, tokenizer, prompts, settings)
        rollouts = generate(model, tokenizer, prompts, settings)
    bf16 = generate(model, tokenizer, prompts, settings, decode=DecodeOptions(dtype="bfloat16"))
    assert [g.completion_ids for g in held_out] == [g.completion_ids for g in plain]
    flat = [lp for g in plain for lp in g.logprobs]
    assert [lp for g in held_out for lp in g.logprobs] == pytest.approx(flat, abs=1e-5)
    assert [g.logprobs for g in rollouts] == [g.logprobs for g in bf16]
    if cpu_bfloat16_kernels() is not None:  # bfloat16 products: log-probs move
        assert [lp for g in rollouts for lp in g.logprobs] != pytest.approx(flat, abs=1e-5)


def test_bfloat16_sampling_runs_its_products_in_bfloat16(tiny):
    from composer_replication.inference.decoding.generate import (
        DecodeOptions,
        evaluation_precision,
        sampling_compute_dtype,
    )
    from composer_replication.inference.decoding.packed_linear import (
        packed_linear_available,
        packed_linears,
    )
    from composer_replication.model.devices import cpu_bfloat16_kernels

    cpu = torch.device("cpu")
    assert sampling_compute_dtype(DecodeOptions(), cpu) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # rollouts follow the learner
        assert sampling_compute_dtype(DecodeOptions(), cpu) == torch.bfloat16
        assert sampling_compute_dtype(DecodeOptions(dtype="float32"), cpu) is None
        with evaluation_precision("auto"):  # held-out answers: float32 on a CPU
            assert sampling_compute_dtype(DecodeOptions(dtype="bfloat16"), cpu) is None
        with evaluation_precision("bfloat16"):
            assert sampling_compute_dtype(DecodeOptions(), cpu) == torch.bfloat16
    assert sampling_compute_dtype(DecodeOptions(dtype="bfloat16"), cpu) == torch.bfloat16
    with evaluation_precision("auto"):  # on a GPU: the rollouts' precision
        assert sampling_compute_dtype(DecodeOptions(), torch.device("cuda")) is None
    with (
        pytest.raises(ValueError, match="use auto, float32 or bfloat16"),
        evaluation_precision("fp16"),
    ):
        pass
    model = copy.deepcopy(tiny[0])
    if cpu_bfloat16_kernels() is None:
        assert not packed_linear_available(model, torch.bfloat16)
        return
    linear = model.lm_head
    x = torch.randn(3, linear.in_features)
    with torch.no_grad():
        reference = x @ linear.weight.T
        with packed_linears(model, batch_hint=3, dtype=torch.bfloat16) as packed:
            assert packed
            y = linear(x)
        rounded = x.bfloat16().float() @ linear.weight.bfloat16().float().T
    assert y.dtype == torch.float32
    assert torch.allclose(y, rounded, atol=2e-2, rtol=2e-2)
    assert not torch.equal(y, reference)  # bfloat16 products, not float32 ones
    assert "forward" not in linear.__dict__  # the module is restored on exit


def test_setup_policy_places_the_policy_with_sdpa(tmp_path, tiny):
    from composer_replication.config.run import RunConfig
    from composer_replication.model.loading import save_checkpoint, tiny_model
    from composer_replication.training.setup import setup_policy

    source = save_checkpoint(tiny_model(seed=0), tmp_path / "m", tokenizer=tiny[1])
    config = RunConfig(model={"source": str(source), "device": "cpu", "dtype": "auto"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # nothing deprecated reaches the log
        policy, _ = setup_policy(config.model)
    assert config.model.lora is not None  # the LoRA path (peft) was the one taken
    assert module_device(policy) == torch.device("cpu")
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert policy.config._attn_implementation == "sdpa"
    bf16 = RunConfig(model={"source": str(source), "device": "cpu", "dtype": "bf16", "lora": None})
    assert {p.dtype for p in setup_policy(bf16.model)[0].parameters()} == {torch.bfloat16}


def test_bf16_autocast_step_matches_float32(tiny):
    """The mixed-precision mechanism (float32 master weights, bfloat16 autocast) on the
    whole step: float32 gradients within bf16 rounding of the float32 step's."""
    model = copy.deepcopy(tiny[0])
    mixed = copy.deepcopy(model)
    batches = pack_samples(_all_samples(), max_tokens=1000, split=None)
    full = train_step(model, batches, reference=model)
    with autocast(Precision(torch.float32, torch.bfloat16), torch.device("cpu")):
        half = train_step(mixed, batches, reference=mixed)
    assert half["loss"] == pytest.approx(full["loss"], rel=2e-2)
    for (name, p), (_, q) in zip(model.named_parameters(), mixed.named_parameters()):
        assert q.dtype == q.grad.dtype == torch.float32, name
        assert float((p.grad - q.grad).norm()) <= 0.05 * float(p.grad.norm()) + 1e-8, name


# --------------------------------------------------------------------------- strays


def test_the_stray_check_catches_a_tensor_created_without_device(tiny):
    model = tiny[0]
    with pytest.raises((RuntimeError, NotImplementedError, AssertionError)), _strays_fail():
        ids = torch.ones(1, 4, dtype=torch.long)  # no device=: a stray
        model(input_ids=ids)


def test_step_creates_no_stray_tensor(tiny):
    model = copy.deepcopy(tiny[0])
    batches = pack_samples(_all_samples(), max_tokens=60, split=None)
    reference = copy.deepcopy(model)
    with _strays_fail():
        metrics = train_step(model, batches, reference=reference)
    assert all(metrics[f"tokens/{c}"] > 0 for c in ("rl", "ce", "ref_kl", "jsd", "dpo"))
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in model.parameters())


def test_sampler_scorer_kl_and_teachers_create_no_stray_tensor(tiny):
    from composer_replication.algo.advantage import grpo_advantages, max_rl_advantages
    from composer_replication.algo.scoring import LocalPrefillScorer
    from composer_replication.inference.decoding.generate import (
        generate,
        reuse_prompt_states,
        seeded_rows,
    )
    from composer_replication.samples.generation import SamplingSettings
    from composer_replication.training.setup import kl_to_initial
    from composer_replication.training.teachers import TeacherModels

    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    teachers = TeacherModels(model, mode="ema")
    batches = pack_samples([_rl_sample(1), _rl_sample(2)], max_tokens=1000, split=None)
    settings = SamplingSettings(max_new_tokens=5, temperature=1.0, stop_strings=("\n\n",))
    greedy = SamplingSettings(max_new_tokens=12, temperature=0.0)
    repetitive = [7, 8, 9, 10] * 6
    with _strays_fail():
        out = generate(model, tokenizer, [[1, 2, 3], [4, 5], [1, 2, 3]], settings)
        # seeded rows, rows joining a running batch, drafts, prompt states kept across calls
        with seeded_rows(5), reuse_prompt_states():
            joined = generate(
                model, tokenizer, [repetitive, [4, 5], [1, 2, 3], [6]], settings, max_rows=2
            )
            drafted = generate(model, tokenizer, [repetitive, repetitive[:9]], greedy, max_rows=1)
        scored = asyncio.run(LocalPrefillScorer(model).score([[1, 2, 3, 4], [5, 6, 7]], [1, 2]))
        kl = kl_to_initial(model, teachers.initial, batches, 1.0)
        teachers.update(model)
        adv = grpo_advantages([1.0, 0.0, 0.5]).tolist() + max_rl_advantages([1.0, 0.0]).tolist()
    assert [len(g.completion_ids) <= 5 for g in out] == [True] * 3
    assert [len(g.completion_ids) <= 5 for g in joined] == [True] * 4
    assert [len(g.completion_ids) for g in drafted] == [12, 12]
    assert [len(s) for s in scored] == [3, 1]
    assert kl == pytest.approx(0.0, abs=1e-6)
    max_rl = 0.5 / (0.5 + 1e-6)  # (r - mean) / (mean + eps)
    assert adv == pytest.approx([0.5, -0.5, 0.0, max_rl, -max_rl])


def test_the_static_decode_loop_creates_no_stray_tensor(tiny):
    """The static loop's buffers, draws, windows and trimming follow the model's device;
    its host-side tensors are built on the host explicitly."""
    from composer_replication.inference.decoding.generate import (
        DecodeOptions,
        SamplingSettings,
        generate,
        seeded_rows,
    )

    model, tokenizer = copy.deepcopy(tiny[0]), tiny[1]
    eos = [tokenizer.eos_token_id, 7, 8, 9, 10, 11]  # rows end at different steps: trimming
    model.generation_config.eos_token_id = eos
    settings = SamplingSettings(max_new_tokens=20, temperature=1.0, stop_strings=("\n",))
    greedy = SamplingSettings(max_new_tokens=6, temperature=0.0)
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3], [6] * 9, [12, 13], [14], [15, 16, 17], [18]] * 2
    static = DecodeOptions(loop="static", sync_every=3)
    with _strays_fail():
        out = generate(model, tokenizer, prompts, settings, decode=static)
        with seeded_rows(5):
            seeded = generate(model, tokenizer, prompts, settings, max_rows=5, decode=static)
        plain = generate(model, tokenizer, prompts[:3], greedy, decode=static)
    assert len(out) == len(seeded) == len(prompts)
    assert all(len(g.completion_ids) <= 20 for g in out + seeded)
    assert [len(g.completion_ids) for g in plain] == [6, 6, 6]


def test_checkpoint_round_trip_creates_no_stray_tensor(tmp_path, tiny):
    from composer_replication.training.checkpoint import CheckpointManager

    model = copy.deepcopy(tiny[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, pack_samples([_rl_sample(1)], max_tokens=100, split=None))
    optimizer.step()
    manager = CheckpointManager(tmp_path)
    path = manager.save(1, model=model, optimizer=optimizer, scheduler=None, extra={})
    restored = copy.deepcopy(tiny[0])
    opt2 = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    with _strays_fail():
        state = manager.load(path, model=restored, optimizer=opt2, scheduler=None)
    assert state["step"] == 1
    for p, q in zip(model.parameters(), restored.parameters()):
        assert torch.equal(p, q)


# --------------------------------------------------------------------------- meta


def test_packer_places_every_tensor_on_the_requested_device():
    batches = pack_samples(_all_samples(), max_tokens=30, split=None, device="meta")
    assert len(batches) > 1
    for mb in batches:
        tensors = [v for v in vars(mb).values() if isinstance(v, torch.Tensor)]
        assert tensors and {t.device.type for t in tensors} == {"meta"}
        assert mb.to("meta") is mb


def test_components_and_ops_run_on_meta(tiny):
    """Paths with no data-dependent control flow, every tensor on meta: any CPU tensor
    they create would raise. (The transformers forward itself reads its attention mask's
    values, so it runs under the stray check above instead.)"""
    from composer_replication.ops.jsd import jsd_from_hidden
    from composer_replication.ops.pairs import PairLossSettings, pair_losses
    from composer_replication.ops.token_losses import ce_loss, ref_kl_loss, rl_loss

    model = copy.deepcopy(tiny[0]).to("meta")
    hidden = torch.empty(2, 6, 64, device="meta", requires_grad=True)
    weight = model.lm_head.weight
    per_token = jsd_from_hidden(hidden[0], weight, hidden[1].detach(), beta=0.5, chunk_size=4)
    per_token.sum().backward()
    assert weight.grad is not None and weight.grad.device.type == "meta"
    lp, inf, adv, mask = (torch.zeros(2, 5, device="meta") for _ in range(4))
    losses = [rl_loss(lp, inf, adv, mask)[0], ce_loss(lp, mask)[0]]
    losses.append(ref_kl_loss(lp, inf, inf, mask, mask)[0])
    pairs = torch.zeros(3, device="meta")
    losses.append(pair_losses(pairs, pairs, pairs, pairs, PairLossSettings(), pairs, pairs))
    assert {t.device.type for t in losses} == {"meta"}
