"""Build the shipped trace-replay DPO pair file with the trace pipeline.

Usage: python scripts/build_default_pairs.py [-o src/composer_replication/envs/data/replay_pairs.jsonl]

What it runs, end to end, for real: Claude Code session files -> ClaudeCodeIngester ->
replay_trace against three OpenAI-compatible teacher endpoints -> extract_dpo_pairs ->
save_pairs. What stands in for the parts an offline build cannot have:
- the sessions are written here, one per TRAIN-split task of the python_functions bank
  (held-out tasks are refused): the user asks for the function, the recorded agent answers
  with a stub that does not implement it (the student action);
- the three teachers are local endpoints (composer_replication.testing.LocalOpenAIServer)
  that answer with the task's reference solution, each formatted a little differently, so
  agreement is decided by the pipeline's whitespace normalisation.
Where teacher models are reachable, run the same pipeline with `composer-replication ingest
/ replay / pairs` on real sessions instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from composer_replication.envs.python_functions import user_message
from composer_replication.envs.task_bank import load_tasks
from composer_replication.ingestion.claude_code import ClaudeCodeIngester
from composer_replication.safety import HeldoutSplit
from composer_replication.teacher_replay import extract_dpo_pairs, replay_trace, save_pairs
from composer_replication.testing.openai_server import LocalOpenAIServer

DEFAULT_OUT = (
    Path(__file__).resolve().parents[1] / "src/composer_replication/envs/data/replay_pairs.jsonl"
)


def _session_lines(session_id: str, prompt: str, answer: str) -> list[str]:
    base = {
        "sessionId": session_id,
        "isSidechain": False,
        "cwd": "/home/dev/tasks",
        "version": "2.0.61",
        "userType": "external",
    }
    user = {
        **base,
        "type": "user",
        "uuid": f"{session_id}-u",
        "parentUuid": None,
        "timestamp": "2026-11-01T10:00:00.000Z",
        "message": {"role": "user", "content": prompt},
    }
    assistant = {
        **base,
        "type": "assistant",
        "uuid": f"{session_id}-a",
        "parentUuid": f"{session_id}-u",
        "timestamp": "2026-11-01T10:00:05.000Z",
        "requestId": f"req_{session_id}",
        "message": {
            "id": f"msg_{session_id}",
            "type": "message",
            "role": "assistant",
            "model": "student",
            "content": [{"type": "text", "text": answer}],
            "stop_reason": "end_turn",
        },
    }
    return [json.dumps(user), json.dumps(assistant)]


def build(out: Path, n_tasks: int = 24) -> int:
    split = HeldoutSplit(heldout_fraction=0.25)  # the run config's default split
    tasks = [t for t in load_tasks() if not split.is_heldout(t.task_id)][:n_tasks]
    split.check_trainable([t.task_id for t in tasks])
    by_prompt = {user_message(t): t for t in tasks}

    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "projects" / "-home-dev-tasks"
        project.mkdir(parents=True)
        for i, task in enumerate(tasks):
            stub = f"```python\n{task.signature}\n    pass\n```"
            lines = _session_lines(f"s{i:03d}", user_message(task), stub)
            (project / f"{task.task_id}.jsonl").write_text("\n".join(lines) + "\n")
        states = list(ClaudeCodeIngester().ingest(project))

    def responder(model: str, messages: list[dict]) -> str:
        prompt = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        task = by_prompt.get(prompt)
        if task is None:
            return "I cannot help with that."
        code = task.reference.strip()
        # teachers differ in layout only; the pipeline's normalisation must see agreement
        return {
            "local/teacher-a": f"```python\n{code}\n```",
            "local/teacher-b": f"```python\n{code}\n```\n",
            "local/teacher-c": f"```python\n\n{code}\n```",
        }[model]

    with LocalOpenAIServer(responder) as server:
        teachers = [
            {
                "slug": slug,
                "input_per_mtok": 0.0,
                "output_per_mtok": 0.0,
                "base_url": server.base_url,
            }
            for slug in ("local/teacher-a", "local/teacher-b", "local/teacher-c")
        ]
        results = asyncio.run(replay_trace(states, teachers=teachers, max_total_usd=1.0))
    actions = [r for r in results if r.get("response_text")]
    pairs = extract_dpo_pairs(states, actions, agreement_threshold=2)
    save_pairs(pairs, out)
    return len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--n-tasks", type=int, default=24)
    ns = parser.parse_args()
    n = build(ns.output, ns.n_tasks)
    print(f"{n} pairs -> {ns.output}")


if __name__ == "__main__":
    main()
