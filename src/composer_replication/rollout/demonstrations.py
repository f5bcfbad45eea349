"""The ``"reference"`` sampling source: an environment's reference solutions as samples.

With ``sampling.source = "reference"`` an ``sft`` entry trains on demonstrations: each
task's prompt followed by its reference solution (in the answer format the environment asks
for) and the end-of-turn token, with cross-entropy on the solution's tokens. Nothing is
sampled or graded; the held-out split applies as to any other entry (only training tasks'
solutions are ever shown). Supervised fine-tuning on demonstrations before or beside RL is
the usual start of a post-training run (e.g. arXiv 2203.02155, arXiv 2501.12948).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from composer_replication.samples.rollouts import DEMONSTRATION_KEY, REFERENCE_KEY, Rollout


class ReferenceSolutions:
    """The sampling source of ``sampling.source = "reference"``: the environment's
    ``demonstrations`` answer each task (environments without them are rejected when the
    run is built)."""

    def __repr__(self) -> str:
        return "ReferenceSolutions()"


def demonstration_rollout(
    task_id: str,
    prompt_ids: Sequence[int],
    answer: str,
    tokenizer: Any,
    *,
    prompt_messages: list[dict[str, Any]] | None = None,
) -> Rollout:
    """A rollout whose completion is ``answer`` followed by the tokenizer's end-of-turn token.

    Its reward is 1.0 (a reference solution passes its tests) and its log-probs are 0.0
    (no model sampled it: only non-rl components may train on it).
    """
    completion = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        completion.append(int(tokenizer.eos_token_id))
    return Rollout(
        task_id=task_id,
        prompt_ids=list(prompt_ids),
        completion_ids=completion,
        inference_logprobs=[0.0] * len(completion),
        reward=1.0,
        prompt_messages=prompt_messages,
        metadata={
            DEMONSTRATION_KEY: True,
            REFERENCE_KEY: answer,
            "finish_reason": "reference",
            "completion_text": answer,
        },
    )
