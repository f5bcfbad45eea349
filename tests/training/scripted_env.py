"""A scripted environment for loop tests: real policy sampling, rewards on a schedule.

Training calls get a reward that rises with every call (the proxy), evaluation calls (at
the evaluation temperature 0) a score that falls: the reward-hacking signature the kill
switch must catch. It records every call so tests can check which tasks were requested.
"""

from __future__ import annotations

from dataclasses import replace

from composer_replication.samples.rollouts import Rollout


class ScriptedEnv:
    name = "scripted"

    def __init__(self, n_tasks: int = 64, *, rising: bool = True, max_new_tokens: int = 6):
        self.ids = [f"scripted-{i:02d}" for i in range(n_tasks)]
        self.rising = rising
        self.max_new_tokens = max_new_tokens
        self.calls: list[tuple[str, list[str]]] = []
        self._train_calls = 0
        self._eval_calls = 0

    def task_ids(self) -> list[str]:
        return list(self.ids)

    def rollouts(self, sampler, tokenizer, task_ids, *, group_size, sampling):
        is_eval = sampling.temperature == 0
        self.calls.append(("eval" if is_eval else "train", list(task_ids)))
        if is_eval:
            self._eval_calls += 1
            score = max(0.0, 0.9 - 0.15 * self._eval_calls) if self.rising else 0.5
        else:
            self._train_calls += 1
            score = min(1.0, 0.1 * self._train_calls) if self.rising else 0.5
        prompts = [
            tokenizer(f"task {tid}: say something")["input_ids"]
            for tid in task_ids
            for _ in range(group_size)
        ]
        settings = replace(sampling, max_new_tokens=self.max_new_tokens)
        gens = sampler.sample_batch(tokenizer, prompts, settings)
        groups = []
        for i, tid in enumerate(task_ids):
            group = []
            for k in range(group_size):
                g = gens[i * group_size + k]
                if is_eval:  # a falling share of fully solved held-out tasks (pass@1)
                    reward = 1.0 if i < round(score * len(task_ids)) else 0.0
                else:  # alternate inside a group so group baselines give non-zero advantages
                    reward = score if k % 2 == 0 else 0.0
                group.append(
                    Rollout(
                        task_id=tid,
                        prompt_ids=g.prompt_ids,
                        completion_ids=g.completion_ids,
                        inference_logprobs=g.logprobs,
                        reward=reward,
                        prompt_messages=[{"role": "user", "content": f"task {tid}"}],
                        feedback=None if reward else "AssertionError: wrong answer",
                    )
                )
            groups.append(group)
        return groups


def make_env(**options) -> ScriptedEnv:
    return ScriptedEnv(**options)


def scripted_run_toml(run_dir, model_dir, *, steps: int, advantage: str, sections: str = "") -> str:
    """A small run on the scripted environment (2 tasks x 2 samples a step, one greedy
    held-out evaluation at the end): ``advantage`` is the advantage table's body,
    ``sections`` any further top-level tables (e.g. ``[inference]``)."""
    return f'''
steps = {steps}
output_dir = "{run_dir}"
[model]
source = "{model_dir}"
{sections}
[eval]
at_start = false
every = {steps}
max_tasks = 1
samples_per_task = 1
temperature = 0
[[envs]]
name = "scripted"
tasks_per_step = 2
[envs.algorithm.sampling]
group_size = 2
max_new_tokens = 6
[envs.algorithm.advantage]
{advantage}
'''
