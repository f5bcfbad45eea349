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

    from composer_replication.model.parts import lora_merged

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


def write_adapter(model: Any, directory: str | Path, version: int, *, max_rank: int) -> Path:
    """Write a peft LoRA policy's adapter (only) to ``directory/policy-v{version}/``
    (``adapter_config.json`` + ``adapter_model.safetensors``), atomically."""
    import shutil

    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        raise ValueError(
            "inference.lora_sync = 'adapter' needs a LoRA policy ([model.lora] set); a full "
            "fine-tune syncs its full weights (lora_sync = 'merged')"
        )
    if config.r > max_rank:
        raise ValueError(
            f"[model.lora] r={config.r} is above inference.max_lora_rank={max_rank}; raise "
            "inference.max_lora_rank"
        )
    target = Path(directory) / f"policy-v{version}"
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


class WeightSync:
    """Pushes new policy versions to an engine server at ``base_url``.

    ``lora_adapter=True``: a LoRA policy's adapter alone is written and loaded as the
    engine's LoRA adapter ``policy-v{version}`` (``/v1/load_lora_adapter``; the previous one
    is unloaded); :attr:`served_model` is then the name to sample with.
    """

    def __init__(
        self,
        base_url: str,
        directory: str | Path,
        *,
        timeout_s: float = 600.0,
        lora_adapter: bool = False,
        max_lora_rank: int = 16,
        base_model: str = "policy",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.directory = Path(directory)
        self.timeout_s = timeout_s
        self.lora_adapter = lora_adapter
        self.max_lora_rank = max_lora_rank
        self.served_model = base_model
        self.version = 0  # the engine starts on the weights it was launched with
        self._current: Path | None = None

    def push(self, model: Any, version: int) -> dict[str, Any]:
        """Write ``model`` as ``version`` and have the engine serve it."""
        if version <= self.version and self._current is not None:
            raise ValueError(
                f"policy version {version} is not newer than the engine's {self.version}"
            )
        if self.lora_adapter and getattr(model, "peft_config", None):
            return self._push_adapter(model, version)
        return self._push_full(model, version)

    def _push_adapter(self, model: Any, version: int) -> dict[str, Any]:
        import shutil

        import httpx

        path = write_adapter(model, self.directory, version, max_rank=self.max_lora_rank)
        name = f"policy-v{version}"
        with httpx.Client(timeout=self.timeout_s) as client:
            response = client.post(
                f"{self.base_url}/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": str(path.resolve())},
            )
            _raise_for(response, "loading the LoRA adapter")
            previous_name = self.served_model
            self.served_model = name
            if previous_name.startswith("policy-v"):
                response = client.post(
                    f"{self.base_url}/v1/unload_lora_adapter", json={"lora_name": previous_name}
                )
                _raise_for(response, f"unloading the LoRA adapter {previous_name}")
        previous, self._current = self._current, path
        if previous is not None and previous != path:
            shutil.rmtree(previous, ignore_errors=True)
        self.version = version
        return {"version": version, "model": name, "path": str(path)}

    def _push_full(self, model: Any, version: int) -> dict[str, Any]:
        import httpx

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
        return {
            "version": version,
            "model": self.served_model,
            "tensors": results[0]["tensors"],
            "path": str(path),
        }


def _raise_for(response: Any, what: str) -> None:
    if response.status_code == 404:
        raise RuntimeError(
            f"{what}: {response.request.url} answered 404; the engine server must run with "
            "VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
            "composer_weight_sync.WeightSyncExtension (EngineServer does both)"
        )
    if response.status_code >= 400:
        raise RuntimeError(f"{what}: HTTP {response.status_code}: {response.text[:2000]}")
