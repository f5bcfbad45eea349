"""A hard USD spend cap that holds under concurrency: reserve before a call, settle after.

Accounting is in integer nano-dollars (prices are converted exactly from their decimal
text and every cost is rounded up), so "settled <= cap" is checked exactly, not up to
float noise.

Guarantee (`SpendBudget`): a call starts only after reserving an upper bound of its cost,
and a reservation is granted only while `settled + in-flight reservations + new <= cap`.
Each call then settles its real cost and releases the reservation. Hence

    settled spend <= max_total_usd + sum over calls of max(0, real cost - reservation)

and the sum is 0 whenever the provider honours `max_tokens` and the prompt upper bound
holds. The bound is the prompt's UTF-8 byte count plus a per-message allowance for chat
template tokens (`prompt_token_upper_bound`): byte-level BPE and SentencePiece-with-byte-
fallback tokenizers never emit more tokens than bytes, so input usage above the bound needs
a provider that adds hidden prompt tokens. `overshoot_usd` measures the sum, so a run
reports exactly how far it went over (0 in every test against the local server that honours
`max_tokens`; the test that makes the server ignore it measures the excess).

When a call's outcome leaves its charge unknown (a timeout after the request was sent, a
dropped connection, an unparsable 200, a response without usage), it settles at its full
reservation: the cap fails closed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = [
    "PER_MESSAGE_TOKEN_ALLOWANCE",
    "Reservation",
    "SpendBudget",
    "cost_nanos",
    "nanos_to_usd",
    "prompt_token_upper_bound",
    "usd_to_nanos",
]

NANOS_PER_USD = 10**9
# Chat templates add a few tokens per message (role markers, separators); 16 covers the
# templates of OpenAI, Anthropic, Llama and Qwen with room to spare.
PER_MESSAGE_TOKEN_ALLOWANCE = 16


def usd_to_nanos(usd: float) -> int:
    """Whole nano-dollars at or below `usd` (exact for the decimal text of the float)."""
    return math.floor(Fraction(repr(float(usd))) * NANOS_PER_USD)


def nanos_to_usd(nanos: int) -> float:
    return nanos / NANOS_PER_USD


def cost_nanos(
    prompt_tokens: int, completion_tokens: int, input_per_mtok: float, output_per_mtok: float
) -> int:
    """Cost in nano-dollars, rounded up: tokens x USD-per-million-tokens / 1e6."""
    exact = (
        prompt_tokens * Fraction(repr(float(input_per_mtok)))
        + completion_tokens * Fraction(repr(float(output_per_mtok)))
    ) * Fraction(NANOS_PER_USD, 10**6)
    return math.ceil(exact)


def prompt_token_upper_bound(messages: Sequence[dict[str, Any]]) -> int:
    """An upper bound of the prompt tokens of `messages`: UTF-8 bytes + template allowance."""
    total = PER_MESSAGE_TOKEN_ALLOWANCE  # the assistant reply's priming tokens
    for message in messages:
        content = message.get("content", "")
        text = content if isinstance(content, str) else repr(content)
        total += len(text.encode("utf-8")) + PER_MESSAGE_TOKEN_ALLOWANCE
    return total


@dataclass(frozen=True)
class Reservation:
    """A granted reservation of `nanos` nano-dollars; settle it exactly once."""

    nanos: int


class SpendBudget:
    """Reserve/settle accounting against `max_total_usd` (see the module docstring).

    `reserve` waits while other calls hold reservations that might free room, and returns
    None (refusal) only when the amount cannot fit even with nothing in flight.
    """

    def __init__(self, max_total_usd: float, *, spent_before_nanos: int = 0) -> None:
        if not isinstance(max_total_usd, int | float) or not math.isfinite(max_total_usd):
            raise ValueError(f"max_total_usd={max_total_usd!r} must be a finite number >= 0")
        if max_total_usd < 0:
            raise ValueError(f"max_total_usd={max_total_usd!r} must be >= 0")
        self.max_total_usd = float(max_total_usd)
        self.cap_nanos = usd_to_nanos(max_total_usd)
        # What earlier runs already spent against the same cap (a cache's ledger).
        self.spent_before_nanos = int(spent_before_nanos)
        self.settled_nanos = self.spent_before_nanos
        self.reserved_nanos = 0
        self.overshoot_nanos = 0
        self.n_refused = 0
        self._changed = asyncio.Event()

    @property
    def settled_usd(self) -> float:
        """Spend settled in this run (earlier runs' spend not included)."""
        return nanos_to_usd(self.settled_nanos - self.spent_before_nanos)

    @property
    def overshoot_usd(self) -> float:
        return nanos_to_usd(self.overshoot_nanos)

    async def reserve(self, nanos: int) -> Reservation | None:
        """Reserve `nanos`; wait for in-flight calls to settle if needed; None = refused."""
        if nanos < 0:
            raise ValueError(f"a reservation must be >= 0 nano-dollars, got {nanos}")
        # Single-threaded event loop: nothing runs between the check and the wait, and
        # `settle` wakes every waiter to re-check.
        while self.settled_nanos + self.reserved_nanos + nanos > self.cap_nanos:
            if self.reserved_nanos == 0:
                self.n_refused += 1
                return None
            self._changed.clear()
            await self._changed.wait()
        self.reserved_nanos += nanos
        return Reservation(nanos)

    def settle(self, reservation: Reservation, actual_nanos: int) -> None:
        """Release `reservation` and add the real cost `actual_nanos` to the spend.

        Synchronous on purpose, so it also completes inside a cancelled task's `finally`.
        """
        self.reserved_nanos -= reservation.nanos
        self.settled_nanos += actual_nanos
        self.overshoot_nanos += max(0, actual_nanos - reservation.nanos)
        self._changed.set()
