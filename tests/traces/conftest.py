"""Fixtures of the trace-pipeline tests (helpers live in `trace_helpers`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from composer_replication.testing.openai_server import LocalOpenAIServer


@pytest.fixture
def server() -> Iterator[LocalOpenAIServer]:
    """A fresh local OpenAI-compatible server (echo replies, no latency, no faults)."""
    with LocalOpenAIServer() as srv:
        yield srv
