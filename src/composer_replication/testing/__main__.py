"""`python -m composer_replication.testing`: serve `LocalOpenAIServer` in the foreground.

Prints the base URL on the first line of stdout, then serves until SIGINT or SIGTERM. Use it
to try `composer-replication replay` offline, or to benchmark a client against a server that
does not share its process (and GIL).
"""

from __future__ import annotations

import argparse
import signal
import threading

from composer_replication.testing.openai_server import LocalOpenAIServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m composer_replication.testing")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument("--reply", default=None, help="fixed reply text (default: echo)")
    parser.add_argument("--api-key", default=None, help="require this bearer key")
    args = parser.parse_args(argv)

    responder = (lambda model, messages: args.reply) if args.reply is not None else None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with LocalOpenAIServer(
        responder, latency_s=args.latency, api_key=args.api_key, host=args.host, port=args.port
    ) as server:
        print(server.base_url, flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
