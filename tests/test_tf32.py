"""``model.tf32``: the CUDA TF32 flags are set for a CUDA device and left alone on a CPU.

Setting ``torch.backends`` flags needs no GPU, so the CUDA branch runs here on a
``torch.device("cuda")`` that is never used; the assertions read the real flags.
"""

from __future__ import annotations

import pytest
import torch

from composer_replication.config import RunConfig
from composer_replication.model.devices import set_tf32


@pytest.fixture(autouse=True)
def _restore_flags():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_is_set_on_a_cuda_device(enabled):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not enabled
    assert set_tf32(enabled, torch.device("cuda", 0)) is True
    assert _flags() == (enabled, enabled)


@pytest.mark.parametrize("before", [(False, True), (True, False)])
@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_leaves_the_cpu_untouched(before, enabled):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    precision = torch.get_float32_matmul_precision()
    assert set_tf32(enabled, torch.device("cpu")) is False
    assert _flags() == before
    assert torch.get_float32_matmul_precision() == precision  # oneDNN's CPU matmuls too


def test_tf32_is_a_model_setting_on_by_default():
    assert RunConfig.default().model.tf32 is True
    assert RunConfig.default(["model.tf32=false"]).model.tf32 is False
    assert "TF32" in RunConfig.model_fields["model"].annotation.model_fields["tf32"].description


def test_setting_up_a_cpu_policy_leaves_the_flags_alone(monkeypatch):
    from composer_replication.training import setup

    calls = []
    monkeypatch.setattr(
        "composer_replication.model.devices.set_tf32",
        lambda enabled, device: calls.append((enabled, device.type)) or set_tf32(enabled, device),
    )
    monkeypatch.setattr(
        "composer_replication.model.loading.load_policy", lambda *a, **k: (_Policy(), None)
    )
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = (False, False)
    config = RunConfig.default(["model.device=cpu", "model.lora=null"])
    setup.setup_policy(config.model)
    assert calls == [(True, "cpu")]
    assert _flags() == (False, False)


class _Policy:
    """Stands in for the loaded model: ``setup_policy`` only calls ``train()`` on it here."""

    def train(self) -> None:
        pass
