"""Helpers shared by the trace-pipeline tests: fixture paths, states, local teachers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_replication.testing.openai_server import LocalOpenAIServer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "claude_code"
PROJECTS = FIXTURES / "projects"
CALC = PROJECTS / "-home-dev-calc"
MAIN_SESSION = CALC / "1f0c7a2e-5b1d-4c3e-9a7f-0d2e4b6c8a10.jsonl"


def make_states(n: int, *, prefix: str = "s", student: str = "student answer") -> list[dict]:
    """`n` small states; the user message names the state so a request maps back to it."""
    return [
        {
            "state_id": f"{prefix}{i}",
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"task {prefix}{i}"},
            ],
            "student_action": student,
        }
        for i in range(n)
    ]


def local_teachers(
    server: LocalOpenAIServer, n: int = 3, *, price_in: float = 1.0, price_out: float = 2.0
) -> list[dict[str, Any]]:
    return [
        {
            "slug": f"local/t{j}",
            "input_per_mtok": price_in,
            "output_per_mtok": price_out,
            "base_url": server.base_url,
        }
        for j in range(n)
    ]


def state_of(request: Any) -> str:
    """The state id a recorded request was made for (see `make_states`)."""
    return request.messages[-1]["content"].removeprefix("task ")
