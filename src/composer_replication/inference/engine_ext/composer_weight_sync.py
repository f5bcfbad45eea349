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

        The names are the Hugging Face checkpoint names (``model.layers.0...``). The load
        goes through the worker's ``reload_weights`` in checkpoint format: after the first
        load a CPU build has repacked its linear weights into kernel layouts (the original
        parameters are empty), so the layers are restored to checkpoint layout, loaded by
        the model's own ``load_weights`` (which maps them onto fused layers) and processed
        again. Returns the new version and how many tensors were read.
        """
        from safetensors.torch import load_file

        reload = getattr(self, "reload_weights", None)
        if reload is None:
            raise RuntimeError(
                "this vLLM worker has no reload_weights (in-place reloads need vLLM >= 0.13)"
            )
        tensors = load_file(path, device="cpu")
        reload(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        self._composer_retie_lm_head()
        self.composer_policy_version = int(version)
        return {"version": int(version), "tensors": len(tensors)}

    def _composer_retie_lm_head(self) -> None:
        """Tie the output head to the reloaded input embeddings again.

        A tied model's checkpoint has no ``lm_head.weight`` (the loader skips it), so the
        in-place reload keeps the head's old kernel tensors, while the embeddings it was
        tied to now hold the new weights. Re-tie and let the head's method re-derive its
        kernel layout (on a CPU build, the packed GEMM weight).
        """
        hf_config = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        if not getattr(hf_config, "tie_word_embeddings", False):
            return
        model: Any = self.model_runner.get_model()  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None or not hasattr(lm_head, "tie_weights"):
            raise RuntimeError(
                f"cannot re-tie the output head of {type(model).__name__} after a reload "
                "(no lm_head / model.embed_tokens)"
            )
        lm_head.tie_weights(embed)
        lm_head.quant_method.process_weights_after_loading(lm_head)

    def composer_policy_version_of(self) -> dict[str, Any]:
        """The version of the weights this worker serves (-1 until the first sync)."""
        return {"version": int(getattr(self, "composer_policy_version", -1))}
