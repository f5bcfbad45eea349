"""A scripted sampler: fixed assistant replies fed through the real agent loop.

It lets an environment validate its own gold answer through the same code path the policy
uses (``FeatureDeletionEnv.solve_with_reference``) and lets tests drive episodes
deterministically, optionally handing over to a real sampler afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from composer_replication.rollout.chat_renderer import ids_of
from composer_replication.samples.generation import Generation, SamplingSettings

SampleFn = Callable[[list[list[int]], SamplingSettings], list[Generation]]


class ScriptedSampler:
    """A deterministic sampler that feeds fixed assistant texts through the agent loop.

    For validating a task's gold solution through the real environment and for tests; it
    replaces the policy, nothing else. ``scripts[i]`` is the list of replies of the i-th
    episode to start (episodes are matched to scripts in the order their first prompt
    arrives, cycling; with ``prompts``, the episode whose first prompt is ``prompts[i]``
    plays ``scripts[i]``); a later prompt continues the script whose earlier output it
    extends.
    When a script runs out, the prompt goes to ``then`` (e.g. ``policy_sampler(...)``) or,
    without one, gets an empty final answer (eos). Replies ending in a stop string finish
    with "stop", others get eos appended; every token's log-prob is ``logprob``. Episodes
    whose token streams are identical cannot be told apart (give them identical scripts).
    """

    def __init__(
        self,
        tokenizer: Any,
        scripts: Sequence[Sequence[str]],
        *,
        then: SampleFn | None = None,
        logprob: float = 0.0,
        prompts: Sequence[Sequence[int]] | None = None,
    ) -> None:
        if not scripts:
            raise ValueError("ScriptedSampler needs at least one script (a list of replies)")
        if prompts is not None and len(prompts) != len(scripts):
            raise ValueError(f"{len(prompts)} prompts for {len(scripts)} scripts; give one each")
        self.tokenizer = tokenizer
        self.scripts = [list(s) for s in scripts]
        # an episode whose first prompt is prompts[i] plays scripts[i], in whatever order
        self._by_prompt = {tuple(p): i for i, p in enumerate(prompts or ())}
        self.then = then
        self.logprob = float(logprob)
        self.calls: list[int] = []  # batch size of every call, for inspection
        self._seen: dict[tuple[int, ...], tuple[int, int]] = {}
        self._started = 0

    def _locate(self, prompt: Sequence[int]) -> tuple[int, int]:
        best: tuple[int, int, int] | None = None
        for seq, (script, turns) in self._seen.items():
            n = len(seq)
            if n <= len(prompt) and (best is None or n > best[0]) and tuple(prompt[:n]) == seq:
                best = (n, script, turns)
        if best is not None:
            return best[1], best[2]
        if tuple(prompt) in self._by_prompt:
            return self._by_prompt[tuple(prompt)], 0
        script = self._started % len(self.scripts)
        self._started += 1
        return script, 0

    def reply(self, prompt: Sequence[int], text: str, settings: SamplingSettings) -> Generation:
        """A Generation of ``text`` as if sampled after ``prompt``."""
        ids = ids_of(self.tokenizer(text, add_special_tokens=False))
        reason = "stop"
        if not any(text.endswith(s) for s in settings.stop_strings if s):
            ids.append(self.tokenizer.eos_token_id)
            reason = "eos"
        if len(ids) > settings.max_new_tokens:
            ids, reason = ids[: settings.max_new_tokens], "length"
        return Generation(
            prompt_ids=list(prompt),
            completion_ids=ids,
            logprobs=[self.logprob] * len(ids),
            finish_reason=reason,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
        )

    def __call__(self, prompts: list[list[int]], settings: SamplingSettings) -> list[Generation]:
        self.calls.append(len(prompts))
        out: list[Generation | None] = [None] * len(prompts)
        where = [self._locate(p) for p in prompts]
        delegated = []
        for i, (prompt, (script, turn)) in enumerate(zip(prompts, where)):
            if turn < len(self.scripts[script]):
                out[i] = self.reply(prompt, self.scripts[script][turn], settings)
            elif self.then is not None:
                delegated.append(i)
            else:
                out[i] = self.reply(prompt, "", settings)
        if delegated:
            for i, gen in zip(delegated, self.then([prompts[i] for i in delegated], settings)):
                out[i] = gen
        if any(g is None for g in out):
            raise ValueError("the `then` sampler returned fewer generations than prompts")
        done: list[Generation] = list(out)  # type: ignore[arg-type]
        for prompt, (script, turn), gen in zip(prompts, where, done):
            self._seen[(*prompt, *gen.completion_ids)] = (script, turn + 1)
        return done
