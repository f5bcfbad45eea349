"""Run one replica's entrypoint: ``python -m composer_replication.diloco.serverless.runner``.

Every backend starts the same command in its process or container::

    python -m composer_replication.diloco.serverless.runner \
        --entrypoint pkg.module[.function] --args-json '{"rendezvous_uri": ...}'

The backend puts the rank in ``REPLICA_RANK`` (or in the variable named by
``entrypoint_args["rank_env"]``); the entrypoint is called with the other arguments as
keywords; without ``--args-json`` they come from the ``DILOCO_ARGS_JSON`` variable (SageMaker
caps each container argument at 256 characters). ``--exit-file`` records the exit code so
another process can read it later, and ``--result-file`` what the entrypoint returned
(``{"kind": "json", "value": ...}`` when it is JSON-serialisable, else
``{"kind": "repr", "value": repr(result)}``; see :func:`read_result`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any

from composer_replication.diloco.serverless.base import RANK_ENV, resolve_entrypoint

ARGS_ENV = "DILOCO_ARGS_JSON"


def run_entrypoint(entrypoint: str, entrypoint_args: dict[str, Any]) -> Any:
    """Resolve and call ``entrypoint(**entrypoint_args)`` minus the ``rank_env`` key."""
    args = dict(entrypoint_args)
    rank_env = args.pop("rank_env", RANK_ENV)
    if rank_env != RANK_ENV and rank_env in os.environ:
        os.environ.setdefault(RANK_ENV, os.environ[rank_env])
    return resolve_entrypoint(entrypoint)(**args)


def write_result(path: str, result: Any) -> None:
    """Write ``result`` to ``path`` atomically (JSON, or its ``repr`` when not JSON-able)."""
    try:
        payload = json.dumps({"kind": "json", "value": result}, allow_nan=False)
    except (TypeError, ValueError):
        payload = json.dumps({"kind": "repr", "value": repr(result)})
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(payload)
    os.replace(tmp, path)


def read_result(path: str | os.PathLike[str]) -> tuple[str | None, Any]:
    """``(kind, value)`` from a result file: ``("json", value)``, ``("repr", text)``, or
    ``(None, None)`` when the file is missing or unreadable (the replica failed first)."""
    try:
        with open(path) as fh:
            record = json.load(fh)
        return record["kind"], record["value"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def build_command(entrypoint: str, entrypoint_args: dict[str, Any]) -> list[str]:
    """The argv a container runs (the image's ``python`` must have this package)."""
    return [
        "python",
        "-m",
        "composer_replication.diloco.serverless.runner",
        "--entrypoint",
        entrypoint,
        "--args-json",
        json.dumps(entrypoint_args, sort_keys=True),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entrypoint", required=True, help="'module' (main) or 'module.fn'")
    parser.add_argument(
        "--args-json",
        default=os.environ.get(ARGS_ENV, "{}"),
        help=f"keyword arguments as JSON (default: ${ARGS_ENV})",
    )
    parser.add_argument("--exit-file", default=None, help="write the exit code here")
    parser.add_argument("--result-file", default=None, help="write the return value here")
    ns = parser.parse_args(argv)
    code = 0
    try:
        result = run_entrypoint(ns.entrypoint, json.loads(ns.args_json))
        if ns.result_file:
            write_result(ns.result_file, result)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if ns.exit_file:
        tmp = f"{ns.exit_file}.tmp"
        with open(tmp, "w") as fh:
            fh.write(str(code))
        os.replace(tmp, ns.exit_file)  # atomic: a reader sees no code or the whole code
    return code


if __name__ == "__main__":
    sys.exit(main())
