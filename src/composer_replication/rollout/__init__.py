"""Episodes: the ``Rollout`` record, multi-turn agents (tool calls in the model's native or
the text format, the chat renderer, the asynchronous episode loop), frozen endpoint
sampling and reference demonstrations. Decoding itself is the inference engines' (see
``composer_replication.inference``)."""

from composer_replication.samples.rollouts import Rollout

__all__ = ["Rollout"]
