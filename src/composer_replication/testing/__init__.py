"""Real local stand-ins for remote services, for tests, benchmarks and offline users.

`openai_server.LocalOpenAIServer`: an OpenAI-compatible chat-completions server on
127.0.0.1 with usage accounting, scripted replies and injectable faults.
`completions_server.CompletionsServer`: the same plus the legacy `/v1/completions` route
(token-id prompts), the route frozen sampling sources use.
"""

from __future__ import annotations

from composer_replication.testing.completions_server import CompletionsServer
from composer_replication.testing.openai_server import (
    Fault,
    LocalOpenAIServer,
    RecordedRequest,
    char_token_count,
    echo_responder,
)

__all__ = [
    "CompletionsServer",
    "Fault",
    "LocalOpenAIServer",
    "RecordedRequest",
    "char_token_count",
    "echo_responder",
]
