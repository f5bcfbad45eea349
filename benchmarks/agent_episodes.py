"""Episode throughput of the agent loop: asynchronous episodes against the per-turn barrier.

Run: ``python benchmarks/agent_episodes.py`` (about a minute on 2 CPU cores). One step of
``--episodes`` episodes (default 8) of ``--turns`` tool calls each then ``finish``, sampled
by the real tiny model (each sampling call decodes ``--decode-tokens`` tokens per prompt,
the cost of a reply) with the replies scripted, so both runs make the same calls. Tool calls
take ``--fast`` seconds, except that in every turn one episode's call (a different episode
each turn) takes ``--slow`` seconds: a test run that hangs, a slow build. Printed side by
side: each scheduling's wall time and episodes per second, and the ratio.

With ``scheduling = "barrier"`` every turn waits for its slowest call, so each turn costs
the slow call; with ``"async"`` each episode samples again as soon as its own call returns,
so an episode pays only its own slow call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, check_seconds, machine_line


def one_step(scheduling: str, args: argparse.Namespace) -> float:
    """Wall seconds of one step's episodes under ``scheduling``."""
    from composer_replication.inference.decoding.generate import SamplingSettings, generate
    from composer_replication.model.loading import tiny_policy
    from composer_replication.rollout.agent import Episode, ScriptedSampler, run_agent_rollouts
    from composer_replication.rollout.tool_calls import format_tool_call

    model, tokenizer = tiny_policy(seed=0)
    scripts = [
        [format_tool_call("work", {"episode": e, "turn": t}) for t in range(args.turns)]
        + [format_tool_call("finish")]
        for e in range(args.episodes)
    ]
    episodes = [
        Episode(f"e{e}", [{"role": "user", "content": f"Task {e}: do the work."}], e)
        for e in range(args.episodes)
    ]
    scripted = ScriptedSampler(tokenizer, scripts)
    decode = SamplingSettings(max_new_tokens=args.decode_tokens, temperature=1.0)

    def sample(prompts, settings):  # the model's decode time, the script's replies
        generate(model, tokenizer, prompts, decode)
        return scripted(prompts, settings)

    def work(state, arguments):
        slow = arguments["turn"] % args.episodes == state  # one slow call per turn
        time.sleep(args.slow if slow else args.fast)
        return "done"

    started = time.perf_counter()
    rollouts = run_agent_rollouts(
        None,
        tokenizer,
        episodes,
        sampling=SamplingSettings(max_new_tokens=64),
        max_turns=args.turns + 2,
        tools={"work": work, "finish": lambda s, a: "bye"},
        sample_fn=sample,
        tool_workers=args.episodes,
        scheduling=scheduling,
    )
    seconds = time.perf_counter() - started
    assert all(r.metadata["end_reason"] == "finish" for r in rollouts)
    assert all(r.metadata["tool_calls"] == args.turns + 1 for r in rollouts)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--fast", type=float, default=0.2, help="seconds of a tool call")
    parser.add_argument("--slow", type=float, default=2.0, help="seconds of the slow call")
    parser.add_argument("--decode-tokens", type=int, default=16)
    args = parser.parse_args()
    check_count(args.episodes, "--episodes", what="episodes")
    check_count(args.turns, "--turns", what="tool calls per episode")
    check_count(args.decode_tokens, "--decode-tokens", what="tokens")
    check_seconds(args.fast, "--fast", zero=True)
    check_seconds(args.slow, "--slow", zero=True)
    print(machine_line())
    print(
        f"{args.episodes} episodes x {args.turns} tool calls + finish; calls take {args.fast} s, "
        f"one per turn {args.slow} s; the tiny model decodes {args.decode_tokens} tokens a reply"
    )
    seconds = {s: one_step(s, args) for s in ("barrier", "async")}
    for name, value in seconds.items():
        print(f"  {name:8s} {value:6.2f} s  ({args.episodes / value:.2f} episodes/s)")
    print(f"async / barrier episode throughput: {seconds['barrier'] / seconds['async']:.2f}x")


if __name__ == "__main__":
    main()
