"""Multi-turn, tool-using rollouts: the policy acts through tool calls, the environment answers.

``run_agent_rollouts`` runs many episodes at once. An episode that is ready (its prompt, or
its last observation, is in place) is sampled together with whichever other episodes are
ready at that moment (one batched sampler call per reply budget); each reply is parsed with
the episode's :class:`~composer_replication.rollout.tool_formats.ToolFormat` (the chat
template's own call syntax, or the project's text format); a call runs in a thread pool,
and the episode is ready again as soon as ITS call returns, whatever the others are doing
(``scheduling = "async"``). ``scheduling = "barrier"`` waits for every call of a turn
before any episode samples again (one batch per turn; the loop's earlier behaviour). An
episode ends when it answers without a tool call (``answer``), calls ``finish``
(``finish``), is cut off by the reply budget before a complete call (``truncated``), has had
``max_turns`` turns (``turn_limit``), reaches its token cap (``token_limit``: prompt
included, ``max_total_tokens``) or a tool fails fatally (``sandbox_error``); the reason is
``metadata["end_reason"]``. ``on_done(index, rollout)`` is called as each episode ends, so
an environment can grade it while the others still run.

Tokens, never re-tokenised: an episode's stream is its prompt ids plus, per turn, the
sampled ids exactly as sampled, then the environment's ids: the template's end-of-turn
tokens for the assistant message (the stop string cut them off), the observation message
and the next turn's generation prompt. The observation ids are the delta between the
conversation rendered with the chat template before and after appending the tool message
(plus the generation prompt); when the earlier rendering is not a prefix of the later one
(templates that rewrite history), the tool message is rendered on its own after a fixed
stand-in conversation and the event ``render_fallback`` is recorded. With a native tool
format the template gets the tools' JSON schemas at every rendering (``Rollout.prompt_tools``
records them).

Attribution per completion token: sampled tokens have ``completion_mask`` 1, role
``assistant`` and their sampling log-prob; end-of-turn tokens and the next turn's generation
prompt have mask 0, role ``assistant``, log-prob 0.0; observation message tokens have mask
0, the role the message was rendered with (``tool``, or ``user`` for a template without a
tool role), log-prob 0.0.

A bad rollout is data: a malformed call (``ToolCallError``) or a tool's ``ToolError``
(bad path, timeout, ...) is sent back to the model as the observation so it can recover,
logged in ``metadata["events"]`` with its turn, and its text becomes ``feedback`` (the last
error site, for SDPO hints). A tool may return a :class:`~.tool_calls.ToolResult` whose
``info`` (e.g. a test run's counts) is logged with the call. Any other exception from a
tool is fatal for that episode only: it ends with ``error`` set. A failing sampler is not
the data's fault and raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from composer_replication.inference.decoding.generate import (
    DecodeOptions,
    Generation,
    InProcessSampler,
    SamplingSettings,
)
from composer_replication.rollout.chat_renderer import TOOL_RESULT_PREFIX, ChatRenderer
from composer_replication.rollout.scripted import SampleFn, ScriptedSampler
from composer_replication.rollout.tool_calls import (
    FINISH_TOOL,
    ToolCall,
    ToolError,
    ToolResult,
)
from composer_replication.rollout.tool_formats import TextToolFormat, ToolFormat
from composer_replication.samples.rollouts import TRUNCATED_END_REASONS, Rollout

if TYPE_CHECKING:
    from composer_replication.roles import Sampler

__all__ = [
    "END_REASONS",
    "SCHEDULING",
    "TOOL_RESULT_PREFIX",
    "TRUNCATED_END_REASONS",
    "ChatRenderer",
    "Episode",
    "SampleFn",
    "ScriptedSampler",
    "Tool",
    "episode_metrics",
    "policy_sampler",
    "run_agent_rollouts",
    "sampler_step",
]

Tool = Callable[[Any, dict[str, Any]], "str | ToolResult"]
#: why an episode ended (``Rollout.metadata["end_reason"]``)
END_REASONS = (
    "answer",
    "finish",
    "truncated",
    "turn_limit",
    "token_limit",
    "sandbox_error",
    "render_error",
)
#: episode scheduling: each episode on its own ("async") or turn by turn ("barrier")
SCHEDULING = ("async", "barrier")


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


def policy_sampler(policy: Any, tokenizer: Any, decode: DecodeOptions | None = None) -> SampleFn:
    """The default sampling step: one batched ``generate`` call with ``policy`` (a model in
    this process), decoded as ``decode`` says (default options: None)."""
    return sampler_step(InProcessSampler(policy, decode=decode), tokenizer)


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
    started: float = field(default_factory=time.perf_counter)
    tool_s: float = 0.0
    episode_s: float = 0.0

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
        self.episode_s = time.perf_counter() - self.started
        self.event(reason, **info)

    def to_rollout(self, tools: list[dict[str, Any]] | None) -> Rollout:
        return Rollout(
            task_id=self.episode.task_id,
            prompt_ids=self.prompt_ids,
            completion_ids=self.ids,
            inference_logprobs=self.logprobs,
            completion_mask=self.mask,
            prompt_messages=[dict(m) for m in self.episode.messages],
            prompt_tools=tools,
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
                "episode_s": self.episode_s,
                "tool_s": self.tool_s,
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


def page(text: str, limit: int) -> str:
    """``text`` when it fits ``limit`` characters, else its head up to a line boundary and a
    note saying how much follows (tools page their own output; this is the backstop)."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    cut = head.rfind("\n")
    if cut > limit // 2:
        head = head[:cut]
    rest = text[len(head) :]
    lines = rest.count("\n") + (0 if rest.endswith("\n") else 1)
    return f"{head}\n[output continues: {len(rest)} more characters in {lines} lines not shown]"


def _close_ids(ids: Sequence[int], close: Sequence[int]) -> list[int]:
    """The end-of-turn ids still missing after ``ids`` (a sampled eos may already be there)."""
    for k in range(min(len(close), len(ids)), 0, -1):
        if list(ids[-k:]) == list(close[:k]):
            return list(close[k:])
    return list(close)


def _short(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]} [... {len(text) - limit} characters ...] {text[-limit // 2 :]}"


def _summary(arguments: Mapping[str, Any], limit: int = 200) -> dict[str, Any]:
    """Arguments for the event log: long strings replaced by their length."""
    out: dict[str, Any] = {}
    for key, value in arguments.items():
        if isinstance(value, str) and len(value) > limit:
            out[key] = f"<{len(value)} characters>"
        elif isinstance(value, (str, int, float, bool)) or value is None:
            out[key] = value
        else:
            out[key] = _short(repr(value), limit)
    return out


@dataclass(frozen=True)
class _Outcome:
    """A call's result: its output text, the failure kind (None: success, a ``ToolError``
    kind, or "fatal"), the tool's ``info`` and the seconds it took."""

    output: str
    kind: str | None
    info: dict[str, Any]
    seconds: float


def _execute(tools: Mapping[str, Tool], run: _Run, call: ToolCall) -> _Outcome:
    started = time.perf_counter()
    info: dict[str, Any] = {}
    try:
        out = tools[call.name](run.episode.state, dict(call.arguments))
    except ToolError as err:
        text = str(err)
        kind: str | None = err.kind
        out = text if text.startswith("Error") else f"Error: {text}"
        info = dict(err.info)
    except Exception as err:  # the environment broke: fatal for this episode only
        out, kind = f"sandbox_error: {call.name}: {type(err).__name__}: {err}", "fatal"
    else:
        kind = None
        if isinstance(out, ToolResult):
            out, info = out.text, dict(out.info)
        out = out if isinstance(out, str) else str(out)
    return _Outcome(out, kind, info, time.perf_counter() - started)


def _record(run: _Run, call: ToolCall, outcome: _Outcome) -> None:
    """Log one executed call and decide what the episode does next."""
    run.tool_s += outcome.seconds
    info = {"name": call.name, "arguments": _summary(call.arguments)}
    if outcome.info:
        info["info"] = outcome.info
    if outcome.kind == "fatal":
        run.error = run.feedback = outcome.output
        run.end("sandbox_error", message=outcome.output, **info)
        return
    if outcome.kind is not None:
        run.feedback = outcome.output
        run.event("tool_error", kind=outcome.kind, message=_short(outcome.output, 500), **info)
    else:
        run.event("tool_call", **info)
    if call.name == FINISH_TOOL:
        run.end("finish", output=_short(outcome.output, 500))
    else:
        run.observation = outcome.output


@dataclass
class _Loop:
    """One ``run_agent_rollouts`` call's fixed parts."""

    sample: SampleFn
    sampling: SamplingSettings
    tool_format: ToolFormat
    renderer: ChatRenderer
    tokenizer: Any
    names: frozenset[str]
    max_turns: int
    max_total_tokens: int
    max_observation_chars: int
    generation_batch: int

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.sampling.stop_strings, *self.tool_format.stop_strings)))

    def sample_replies(self, runs: Sequence[_Run]) -> list[tuple[_Run, ToolCall]]:
        """One reply per run (batched by reply budget), parsed: the calls to execute; runs
        that answered, were cut off or sent a malformed call are settled here."""
        by_budget: dict[int, list[_Run]] = {}
        for run in runs:
            budget = min(self.sampling.max_new_tokens, self.max_total_tokens - run.length)
            if budget < 1:
                run.end("token_limit", tokens=run.length)
            else:
                by_budget.setdefault(budget, []).append(run)
        jobs = []
        for budget, group in by_budget.items():
            settings = replace(self.sampling, max_new_tokens=budget, stop_strings=self.stops)
            for start in range(0, len(group), self.generation_batch):
                chunk = group[start : start + self.generation_batch]
                gens = self.sample([[*r.prompt_ids, *r.ids] for r in chunk], settings)
                if len(gens) != len(chunk):
                    raise ValueError(
                        f"the sampler returned {len(gens)} generations for {len(chunk)} prompts"
                    )
                for run, gen in zip(chunk, gens):
                    call = self._take_reply(
                        run, _normalise(gen, budget, self.stops, self.tokenizer)
                    )
                    if call is not None:
                        jobs.append((run, call))
        return jobs

    def _take_reply(self, run: _Run, gen: Generation) -> ToolCall | None:
        run.append(gen.completion_ids, gen.logprobs, 1, "assistant")
        run.conversation.append({"role": "assistant", "content": gen.text})
        run.finish_reasons.append(gen.finish_reason)
        run.turns += 1
        parsed = self.tool_format.parse(gen.text, self.names)
        if isinstance(parsed, ToolCall):
            run.tool_calls += 1
            return parsed
        if gen.finish_reason == "length":  # cut off by the budget: not an answer
            run.end("truncated", kind=parsed.kind, tokens=len(gen.completion_ids))
        elif parsed.kind == "no_call":
            run.end("answer", finish_reason=gen.finish_reason)
        else:
            run.observation = run.feedback = parsed.message
            run.event("parse_error", kind=parsed.kind, message=parsed.message, name=parsed.name)
        return None

    def observe(self, run: _Run) -> None:
        """Append the pending observation as tokens, unless the episode is out of turns or
        tokens."""
        observation, run.observation = run.observation, None
        if observation is None or run.done:
            return
        if run.turns >= self.max_turns:
            run.end("turn_limit")
            return
        message = self.renderer.tool_message(page(observation, self.max_observation_chars))
        close = _close_ids(run.ids, self.renderer.turn_close_ids)
        try:
            obs = self.renderer.observation_ids(run.conversation, message)
        except Exception as err:  # a template that cannot render this content: this episode
            run.error = f"render_error: {type(err).__name__}: {err}"
            run.end("render_error", message=run.error)
            return
        if obs.how != "delta":
            run.event("render_fallback", method=obs.how)
        if run.length + len(close) + len(obs.ids) >= self.max_total_tokens:
            run.end("token_limit", tokens=run.length + len(close) + len(obs.ids))
            return
        run.append(close, [0.0] * len(close), 0, "assistant")
        run.append(obs.message, [0.0] * len(obs.message), 0, obs.role)
        run.append(obs.header, [0.0] * len(obs.header), 0, "assistant")
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
    tool_format: ToolFormat | None = None,
    scheduling: str = "async",
    on_done: Callable[[int, Rollout], None] | None = None,
    decode: DecodeOptions | None = None,
) -> list[Rollout]:
    """Run every episode to its end; one unscored ``Rollout`` per episode, in order.

    Args:
        policy: The model sampled with ``generate`` (unused when ``sample_fn`` is given).
        tokenizer: Its tokenizer; the chat template renders prompts and observations.
        episodes: Prompt messages and per-episode tool state.
        sampling: Temperature and per-turn ``max_new_tokens``; the tool format's stop
            strings are added to its own.
        max_turns: Assistant turns per episode at most (the last turn's call still runs;
            its output is not appended).
        tools: Tool name -> ``fn(state, arguments) -> str | ToolResult``; calling
            ``finish`` (when it is one of the tools) ends the episode.
        max_total_tokens: Cap on prompt + completion tokens of one episode.
        max_observation_chars: A longer tool output keeps its head and says how much
            follows (tools page their own output within it).
        sample_fn: The sampling step ``(prompts, settings) -> generations``; default
            ``policy_sampler(policy, tokenizer)``.
        tool_workers: Threads running tool calls.
        generation_batch: Prompts per sampling call.
        tool_format: How calls are written and read (default: the project's text format;
            a native format also gives the template its tools).
        scheduling: "async" (each episode samples again as soon as its own call returns) or
            "barrier" (every call of a turn returns before any episode samples again).
        on_done: Called as ``on_done(index, rollout)`` when episode ``index`` ends (from
            this thread), e.g. to start grading it.
        decode: The decode loop of the default sampling step (a ``sample_fn`` built from
            a sampler carries its own).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns} must be >= 1")
    if max_total_tokens < 1 or max_observation_chars < 1:
        raise ValueError(
            f"max_total_tokens={max_total_tokens} and max_observation_chars="
            f"{max_observation_chars} must be >= 1"
        )
    if scheduling not in SCHEDULING:
        raise ValueError(f"scheduling={scheduling!r}; use one of {', '.join(SCHEDULING)}")
    bad = sorted(name for name, fn in tools.items() if not callable(fn))
    if bad:
        raise TypeError(f"tools {bad} are not callable; map each name to fn(state, arguments)")
    if sample_fn is None and policy is None:
        raise ValueError("run_agent_rollouts needs a policy or a sample_fn")
    tool_format = tool_format or TextToolFormat(())
    chat_tools = tool_format.chat_tools
    loop = _Loop(
        sample=sample_fn or policy_sampler(policy, tokenizer, decode),
        sampling=sampling,
        tool_format=tool_format,
        renderer=ChatRenderer(tokenizer, chat_tools),
        tokenizer=tokenizer,
        names=frozenset(tools),
        max_turns=max_turns,
        max_total_tokens=max_total_tokens,
        max_observation_chars=max_observation_chars,
        generation_batch=max(1, generation_batch),
    )
    runs = []
    for episode in episodes:
        run = _Run(
            episode,
            loop.renderer.prompt_ids(episode.messages),
            [dict(m) for m in episode.messages],
        )
        if run.length >= max_total_tokens:
            run.error = f"token_limit: the prompt has {run.length} tokens >= {max_total_tokens}"
            run.end("token_limit", tokens=run.length)
        runs.append(run)
    index = {id(run): i for i, run in enumerate(runs)}
    rollouts: list[Rollout | None] = [None] * len(runs)

    def settle(run: _Run) -> None:
        rollout = rollouts[index[id(run)]] = run.to_rollout(chat_tools)
        if on_done is not None:
            on_done(index[id(run)], rollout)

    for run in runs:
        if run.done:
            settle(run)
    ready = [r for r in runs if not r.done]
    inflight: dict[Future[_Outcome], tuple[_Run, ToolCall]] = {}
    with ThreadPoolExecutor(max(1, tool_workers)) as pool:
        while ready or inflight:
            if inflight and (scheduling == "barrier" or not ready):
                wait(
                    inflight,
                    return_when="ALL_COMPLETED" if scheduling == "barrier" else FIRST_COMPLETED,
                )
            for future in [f for f in inflight if f.done()]:  # in submission order
                run, call = inflight.pop(future)
                _record(run, call, future.result())
                loop.observe(run)
                if run.done:
                    settle(run)
                else:
                    ready.append(run)
            if not ready:
                continue
            batch = ready if scheduling == "barrier" else ready[: loop.generation_batch]
            ready = [r for r in ready if r not in batch]
            for run, call in loop.sample_replies(batch):
                inflight[pool.submit(_execute, tools, run, call)] = (run, call)
            for run in batch:
                if run.observation is not None:  # a malformed call: its error is the answer
                    loop.observe(run)
                    if not run.done:
                        ready.append(run)
                if run.done:
                    settle(run)
    return [r for r in rollouts if r is not None]


def episode_metrics(rollouts: Sequence[Rollout], prefix: str = "agent/") -> dict[str, float]:
    """What a set of agent episodes did, as metrics (empty when none is an agent episode).

    ``turns_mean``, ``tool_calls_mean`` and ``episode_tokens_mean`` (prompt + completion)
    per episode; ``calls/<tool>`` (calls that ran, failed ones included) and ``tool_errors``
    (calls that failed) in all; ``parse_failures`` (replies that tried to call a tool and
    could not be read), ``call_attempts`` (replies that tried to call one: calls that ran
    and parse failures) and ``parse_failure_rate`` (the failures' share of the attempts); ``end/<reason>``: the share of episodes that ended so (``END_REASONS``);
    ``episode_s_mean`` and ``tool_s_mean``: wall seconds per episode, and of its tools.
    """
    episodes = [r for r in rollouts if r.metadata.get("end_reason") is not None]
    if not episodes:
        return {}
    n = len(episodes)
    calls: dict[str, int] = {}
    tool_errors = parse_failures = 0
    for r in episodes:
        for event in r.metadata.get("events", ()):
            kind = event.get("type")
            if kind in ("tool_call", "tool_error") or (
                kind == "sandbox_error" and event.get("name")
            ):
                calls[event["name"]] = calls.get(event["name"], 0) + 1
            tool_errors += kind in ("tool_error", "sandbox_error")
            parse_failures += kind == "parse_error"
    attempted = sum(calls.values()) + parse_failures
    out = {
        "turns_mean": sum(int(r.metadata.get("turns", 0)) for r in episodes) / n,
        "tool_calls_mean": sum(int(r.metadata.get("tool_calls", 0)) for r in episodes) / n,
        "episode_tokens_mean": sum(len(r.prompt_ids) + len(r.completion_ids) for r in episodes) / n,
        "tool_errors": float(tool_errors),
        "parse_failures": float(parse_failures),
        "call_attempts": float(attempted),
        "parse_failure_rate": parse_failures / attempted if attempted else 0.0,
        "episode_s_mean": sum(float(r.metadata.get("episode_s", 0.0)) for r in episodes) / n,
        "tool_s_mean": sum(float(r.metadata.get("tool_s", 0.0)) for r in episodes) / n,
    }
    for reason in END_REASONS:
        out[f"end/{reason}"] = sum(r.metadata["end_reason"] == reason for r in episodes) / n
    for name, count in sorted(calls.items()):
        out[f"calls/{name}"] = float(count)
    return {f"{prefix}{key}": value for key, value in out.items()}
