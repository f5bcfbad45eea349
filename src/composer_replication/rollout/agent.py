"""Multi-turn, tool-using rollouts: the policy acts through tool calls, the environment answers.

``run_agent_rollouts`` runs many episodes at once. Each turn, every live episode's token
stream is sampled in one batch (stop string ``</tool_call>``); each reply is parsed
(``rollout.tool_calls`` documents the format); the calls run (different episodes' tools in
parallel threads, one episode's tools in order); each observation is appended as tokens.
An episode ends when it answers without a tool call, calls ``finish``, has had
``max_turns`` turns, hits its token cap (``max_total_tokens``, prompt included) or a tool
fails fatally.

Tokens, never re-tokenised: an episode's stream is its prompt ids plus, per turn, the
sampled ids exactly as sampled, then the environment's ids: the template's end-of-turn
tokens for the assistant message (the stop string cut them off) and the observation. The
observation ids are the delta between the conversation rendered with the chat template
before and after appending the tool message plus the next generation prompt; when the
earlier rendering is not a prefix of the later one (templates that rewrite history), the
tool message is rendered on its own after a fixed stand-in conversation and the event
``render_fallback`` is recorded.

Attribution per completion token: sampled tokens have ``completion_mask`` 1, role
``assistant`` and their sampling log-prob; end-of-turn tokens have mask 0, role
``assistant``, log-prob 0.0; observation tokens have mask 0, role ``tool``, log-prob 0.0.

A bad rollout is data: a malformed call (``ToolCallError``) or a tool's ``ToolError``
(bad path, timeout, ...) is sent back to the model as the observation so it can recover,
logged in ``metadata["events"]``, and its text becomes ``feedback`` (the last error site,
for SDPO hints). Any other exception from a tool is fatal for that episode only: it ends
with ``error`` set. A failing sampler is not the data's fault and raises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from composer_replication.rollout.chat_renderer import TOOL_RESULT_PREFIX, ChatRenderer
from composer_replication.rollout.generate import Generation, InProcessSampler, SamplingSettings
from composer_replication.rollout.scripted import SampleFn, ScriptedSampler
from composer_replication.rollout.tool_calls import (
    FINISH_TOOL,
    STOP_STRINGS,
    ToolCall,
    ToolError,
    parse_tool_call,
)
from composer_replication.rollout.types import Rollout

if TYPE_CHECKING:
    from composer_replication.roles import Sampler

__all__ = [
    "TOOL_RESULT_PREFIX",
    "ChatRenderer",
    "Episode",
    "SampleFn",
    "ScriptedSampler",
    "Tool",
    "policy_sampler",
    "run_agent_rollouts",
    "sampler_step",
]

Tool = Callable[[Any, dict[str, Any]], str]


@dataclass
class Episode:
    """One attempt to run: the prompt ``messages`` and the ``state`` every tool receives."""

    task_id: str
    messages: list[dict[str, str]]
    state: Any = None


def sampler_step(sampler: Sampler, tokenizer: Any) -> SampleFn:
    """The sampling step of an agent turn: one batched call of ``sampler``."""

    def sample(prompts: list[list[int]], settings: SamplingSettings) -> list[Generation]:
        return sampler.sample_batch(tokenizer, prompts, settings)

    return sample


def policy_sampler(policy: Any, tokenizer: Any) -> SampleFn:
    """The default sampling step: one batched ``generate`` call with ``policy`` (a model in
    this process)."""
    return sampler_step(InProcessSampler(policy), tokenizer)


@dataclass
class _Run:
    """An episode in progress."""

    episode: Episode
    prompt_ids: list[int]
    conversation: list[dict[str, str]]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    done: bool = False
    end_reason: str | None = None
    feedback: str | None = None
    error: str | None = None
    observation: str | None = None  # the current turn's tool output, until appended

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def append(self, ids: Sequence[int], logprobs: Sequence[float], mask: int, role: str) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.mask += [mask] * len(ids)
        self.roles += [role] * len(ids)

    def event(self, event_type: str, **info: Any) -> None:
        self.events.append({"turn": self.turns, "type": event_type, **info})

    def end(self, reason: str, **info: Any) -> None:
        self.done, self.end_reason = True, reason
        self.event(reason, **info)

    def to_rollout(self) -> Rollout:
        return Rollout(
            task_id=self.episode.task_id,
            prompt_ids=self.prompt_ids,
            completion_ids=self.ids,
            inference_logprobs=self.logprobs,
            completion_mask=self.mask,
            prompt_messages=[dict(m) for m in self.episode.messages],
            token_roles=self.roles,
            feedback=self.feedback,
            error=self.error,
            metadata={
                "events": self.events,
                "turns": self.turns,
                "tool_calls": self.tool_calls,
                "end_reason": self.end_reason,
                "finish_reasons": self.finish_reasons,
                "conversation": self.conversation,
            },
        )


def _normalise(gen: Generation, budget: int, stops: Sequence[str], tokenizer: Any) -> Generation:
    """Repair what the sampler may hand back: a pad token after a stop string, overlong."""
    ids, logprobs, reason = list(gen.completion_ids), list(gen.logprobs), gen.finish_reason
    if len(ids) != len(logprobs):
        raise ValueError(
            f"the sampler returned {len(ids)} tokens but {len(logprobs)} log-probs; a sampler "
            "must give one log-prob per completion token"
        )
    changed = False
    # generate() pads a row that stopped on a stop string while its batch ran on; when the
    # pad id is the eos id it keeps one pad token and reports "eos". Drop it.
    if reason == "eos" and len(ids) > 1 and any(s in tokenizer.decode(ids[:-1]) for s in stops):
        ids, logprobs, reason, changed = ids[:-1], logprobs[:-1], "stop", True
    if len(ids) > budget:
        ids, logprobs, reason, changed = ids[:budget], logprobs[:budget], "length", True
    if not changed:
        return gen
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return replace(gen, completion_ids=ids, logprobs=logprobs, finish_reason=reason, text=text)


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    cut = len(text) - limit
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[-tail:]}"


def _close_ids(ids: Sequence[int], close: Sequence[int]) -> list[int]:
    """The end-of-turn ids still missing after ``ids`` (a sampled eos may already be there)."""
    for k in range(min(len(close), len(ids)), 0, -1):
        if list(ids[-k:]) == list(close[:k]):
            return list(close[k:])
    return list(close)


def _summary(arguments: Mapping[str, Any], limit: int = 200) -> dict[str, Any]:
    """Arguments for the event log: long strings replaced by their length."""
    out: dict[str, Any] = {}
    for key, value in arguments.items():
        if isinstance(value, str) and len(value) > limit:
            out[key] = f"<{len(value)} characters>"
        elif isinstance(value, (str, int, float, bool)) or value is None:
            out[key] = value
        else:
            out[key] = _truncate(repr(value), limit)
    return out


def _execute(tools: Mapping[str, Tool], run: _Run, call: ToolCall) -> tuple[str, str | None]:
    """(output, failure kind): kind None = success, a ``ToolError`` kind, or "fatal"."""
    try:
        out = tools[call.name](run.episode.state, dict(call.arguments))
    except ToolError as err:
        text = str(err)
        return (text if text.startswith("Error") else f"Error: {text}"), err.kind
    except Exception as err:  # the environment broke: fatal for this episode only
        return f"sandbox_error: {call.name}: {type(err).__name__}: {err}", "fatal"
    return (out if isinstance(out, str) else str(out)), None


def _sample_turn(
    live: Sequence[_Run],
    sample: SampleFn,
    sampling: SamplingSettings,
    stops: tuple[str, ...],
    max_total_tokens: int,
    generation_batch: int,
    tokenizer: Any,
) -> None:
    """One reply per live episode, batched by remaining token budget."""
    by_budget: dict[int, list[_Run]] = {}
    for run in live:
        budget = min(sampling.max_new_tokens, max_total_tokens - run.length)
        if budget < 1:
            run.end("token_limit", tokens=run.length)
        else:
            by_budget.setdefault(budget, []).append(run)
    for budget, group in by_budget.items():
        settings = replace(sampling, max_new_tokens=budget, stop_strings=stops)
        for start in range(0, len(group), max(1, generation_batch)):
            chunk = group[start : start + max(1, generation_batch)]
            gens = sample([[*r.prompt_ids, *r.ids] for r in chunk], settings)
            if len(gens) != len(chunk):
                raise ValueError(
                    f"the sampler returned {len(gens)} generations for {len(chunk)} prompts"
                )
            for run, gen in zip(chunk, gens):
                gen = _normalise(gen, budget, stops, tokenizer)
                run.append(gen.completion_ids, gen.logprobs, 1, "assistant")
                run.conversation.append({"role": "assistant", "content": gen.text})
                run.finish_reasons.append(gen.finish_reason)
                run.turns += 1


def _parse_turn(live: Sequence[_Run], names: frozenset[str]) -> list[tuple[_Run, ToolCall]]:
    """Parse each reply: end answers, queue calls, turn malformed calls into observations."""
    jobs = []
    for run in live:
        parsed = parse_tool_call(run.conversation[-1]["content"], names)
        if isinstance(parsed, ToolCall):
            run.tool_calls += 1
            jobs.append((run, parsed))
        elif parsed.kind == "no_call":
            run.end("answer", finish_reason=run.finish_reasons[-1])
        else:
            run.observation = run.feedback = parsed.message
            run.event("parse_error", kind=parsed.kind, message=parsed.message, name=parsed.name)
    return jobs


def _record(run: _Run, call: ToolCall, output: str, kind: str | None) -> None:
    """Log one executed call and decide what the episode does next."""
    info = {"name": call.name, "arguments": _summary(call.arguments)}
    if kind == "fatal":
        run.error = run.feedback = output
        run.end("sandbox_error", message=output, **info)
        return
    if kind is not None:
        run.feedback = output
        run.event("tool_error", kind=kind, message=_truncate(output, 500), **info)
    else:
        run.event("tool_call", **info)
    if call.name == FINISH_TOOL:
        run.end("finish", output=_truncate(output, 500))
    else:
        run.observation = output


def _observe(
    run: _Run,
    renderer: ChatRenderer,
    max_turns: int,
    max_total_tokens: int,
    max_observation_chars: int,
) -> None:
    """Append the pending observation as tokens, unless the episode is out of turns/tokens."""
    observation, run.observation = run.observation, None
    if observation is None or run.done:
        return
    if run.turns >= max_turns:
        run.end("turn_limit")
        return
    message = renderer.tool_message(_truncate(observation, max_observation_chars))
    close = _close_ids(run.ids, renderer.turn_close_ids)
    try:
        obs_ids, how = renderer.observation_ids(run.conversation, message)
    except Exception as err:  # a template that cannot render this content: this episode only
        run.error = f"render_error: {type(err).__name__}: {err}"
        run.end("render_error", message=run.error)
        return
    if how != "delta":
        run.event("render_fallback", method=how)
    if run.length + len(close) + len(obs_ids) >= max_total_tokens:
        run.end("token_limit", tokens=run.length + len(close) + len(obs_ids))
        return
    run.append(close, [0.0] * len(close), 0, "assistant")
    run.append(obs_ids, [0.0] * len(obs_ids), 0, "tool")
    run.conversation.append(message)


def run_agent_rollouts(
    policy: Any,
    tokenizer: Any,
    episodes: Sequence[Episode],
    *,
    sampling: SamplingSettings,
    max_turns: int,
    tools: Mapping[str, Tool],
    max_total_tokens: int = 4096,
    max_observation_chars: int = 4000,
    sample_fn: SampleFn | None = None,
    tool_workers: int = 4,
    generation_batch: int = 16,
) -> list[Rollout]:
    """Run every episode to its end; one unscored ``Rollout`` per episode, in order.

    Args:
        policy: The model sampled with ``generate`` (unused when ``sample_fn`` is given).
        tokenizer: Its tokenizer; the chat template renders prompts and observations.
        episodes: Prompt messages and per-episode tool state.
        sampling: Temperature and per-turn ``max_new_tokens``; ``</tool_call>`` is added to
            its stop strings.
        max_turns: Assistant turns per episode at most (the last turn's call still runs;
            its output is not appended).
        tools: Tool name -> ``fn(state, arguments) -> str``; calling ``finish`` (when it is
            one of the tools) ends the episode.
        max_total_tokens: Cap on prompt + completion tokens of one episode.
        max_observation_chars: Longer tool outputs keep their head and tail.
        sample_fn: The sampling step ``(prompts, settings) -> generations``; default
            ``policy_sampler(policy, tokenizer)``.
        tool_workers: Threads running different episodes' tool calls.
        generation_batch: Prompts per sampling call.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns} must be >= 1")
    if max_total_tokens < 1 or max_observation_chars < 1:
        raise ValueError(
            f"max_total_tokens={max_total_tokens} and max_observation_chars="
            f"{max_observation_chars} must be >= 1"
        )
    bad = sorted(name for name, fn in tools.items() if not callable(fn))
    if bad:
        raise TypeError(f"tools {bad} are not callable; map each name to fn(state, arguments)")
    if sample_fn is None and policy is None:
        raise ValueError("run_agent_rollouts needs a policy or a sample_fn")
    renderer = ChatRenderer(tokenizer)
    sample = sample_fn or policy_sampler(policy, tokenizer)
    stops = tuple(dict.fromkeys((*sampling.stop_strings, *STOP_STRINGS)))
    names = frozenset(tools)
    runs = []
    for episode in episodes:
        run = _Run(
            episode, renderer.prompt_ids(episode.messages), [dict(m) for m in episode.messages]
        )
        if run.length >= max_total_tokens:
            run.error = f"token_limit: the prompt has {run.length} tokens >= {max_total_tokens}"
            run.end("token_limit", tokens=run.length)
        runs.append(run)
    with ThreadPoolExecutor(max(1, tool_workers)) as pool:
        for _ in range(max_turns):
            live = [r for r in runs if not r.done]
            if not live:
                break
            _sample_turn(
                live, sample, sampling, stops, max_total_tokens, generation_batch, tokenizer
            )
            jobs = _parse_turn([r for r in live if not r.done], names)
            results = list(pool.map(lambda job: _execute(tools, *job), jobs))
            for (run, call), (output, kind) in zip(jobs, results):
                _record(run, call, output, kind)
            for run in live:
                _observe(run, renderer, max_turns, max_total_tokens, max_observation_chars)
    return [r.to_rollout() for r in runs]
