"""Weight sync inside a vLLM worker: reload the policy from a safetensors file in place.

Loaded by the engine with ``--worker-extension-cls composer_weight_sync.WeightSyncExtension``
(this folder on its ``PYTHONPATH``); vLLM mixes the class into its worker, so ``self`` is
the worker. It imports only torch and safetensors, both in the engine's virtualenv, and
nothing of the training package. The trainer calls the methods over HTTP
(``POST /collective_rpc``, arguments as strings).
"""

from __future__ import annotations

from typing import Any


class WeightSyncExtension:
    """Worker methods for versioned weight reloads."""

    def composer_load_weights(self, path: str, version: str) -> dict[str, Any]:
        """Load every tensor of the safetensors file at ``path`` into the running model.

        The names are the Hugging Face checkpoint names (``model.layers.0...``); the model's
        own ``load_weights`` maps them onto its fused layers. Returns the new version and how
        many tensors were read.
        """
        from safetensors.torch import load_file

        tensors = load_file(path, device="cpu")
        model: Any = self.model_runner.get_model()  # type: ignore[attr-defined]
        model.load_weights(weights=iter(tensors.items()))
        self.composer_policy_version = int(version)
        return {"version": int(version), "tensors": len(tensors)}

    def composer_policy_version_of(self) -> dict[str, Any]:
        """The version of the weights this worker serves (-1 until the first sync)."""
        return {"version": int(getattr(self, "composer_policy_version", -1))}
