"""Versioned weight sync from the trainer to the engine.

After an optimizer step the trainer writes the policy's weights once, as one safetensors
file under Hugging Face names (a LoRA policy's adapters merged into the base weights, the
way the in-process sampler samples), and the engine's workers reload them in place
(``composer_load_weights`` of :mod:`.engine_ext.composer_weight_sync`, called through
``/collective_rpc``). The engine's prefix cache is then reset, since its cached keys and
values came from the old weights. The file of the previous version is removed once the
engine has loaded the new one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."


def engine_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The policy's weights under the plain Hugging Face names an engine loads.

    A peft (LoRA) model is read with its adapters merged; its wrapper prefixes and
    ``base_layer`` segments are stripped and the adapter tensors left out. Tensors that
    share storage (tied embeddings) are written once, under their first name.
    """
    import torch

    from composer_replication.model_parts import lora_merged

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    with torch.no_grad(), lora_merged(model):
        for name, tensor in model.state_dict().items():
            if "lora_" in name:
                continue
            name = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            # a copy: the merged weights are restored on leaving lora_merged
            out[name] = tensor.detach().to("cpu").contiguous().clone()
    return out


def write_weights(model: Any, directory: str | Path, version: int) -> Path:
    """Write version ``version`` of the policy to ``directory/policy-v{version}.safetensors``
    (atomically: a temporary name, then a rename)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"policy-v{version}.safetensors"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(engine_state_dict(model), str(tmp), metadata={"policy_version": str(version)})
    os.replace(tmp, path)
    return path


class WeightSync:
    """Pushes new policy versions to an engine server at ``base_url``."""

    def __init__(self, base_url: str, directory: str | Path, *, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.directory = Path(directory)
        self.timeout_s = timeout_s
        self.version = 0  # the engine starts on the weights it was launched with
        self._current: Path | None = None

    def push(self, model: Any, version: int) -> dict[str, Any]:
        """Write ``model`` as ``version`` and have every engine worker load it."""
        import httpx

        if version <= self.version and self._current is not None:
            raise ValueError(
                f"policy version {version} is not newer than the engine's {self.version}"
            )
        path = write_weights(model, self.directory, version)
        body = {
            "method": "composer_load_weights",
            "args": [str(path.resolve()), str(version)],
            "timeout": self.timeout_s,
        }
        with httpx.Client(timeout=self.timeout_s) as client:
            response = client.post(f"{self.base_url}/collective_rpc", json=body)
            _raise_for(response, "loading the synced weights")
            results = response.json()["results"]
            reset = client.post(f"{self.base_url}/reset_prefix_cache")
            _raise_for(reset, "resetting the prefix cache after a weight sync")
        bad = [r for r in results if not isinstance(r, dict) or r.get("version") != version]
        if bad:
            raise RuntimeError(f"engine workers did not report version {version}: {results}")
        previous, self._current = self._current, path
        if previous is not None and previous != path:
            previous.unlink(missing_ok=True)
        self.version = version
        return {"version": version, "tensors": results[0]["tensors"], "path": str(path)}


def _raise_for(response: Any, what: str) -> None:
    if response.status_code == 404:
        raise RuntimeError(
            f"{what}: {response.request.url} answered 404; the engine server must run with "
            "VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
            "composer_weight_sync.WeightSyncExtension (EngineServer does both)"
        )
    if response.status_code >= 400:
        raise RuntimeError(f"{what}: HTTP {response.status_code}: {response.text[:2000]}")
