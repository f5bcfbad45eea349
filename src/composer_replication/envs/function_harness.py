"""The harness that runs inside the sandbox: call the candidate, report plain data.

Run as ``python _harness.py`` in a workdir holding ``solution.py`` (the candidate),
``_plain.py`` (:mod:`composer_replication.envs.plain_data`) and ``calls.json``
(``{"entry_point": name, "calls": [{"id": n, "args": [...]}, ...]}``, arguments encoded as
plain data). It prints ``HARNESS_MARKER`` before anything of the candidate runs (so the
grader can tell a sandbox that never started from a candidate that crashed), then reports
on stdout, each record on a line of its own behind ``RECORD_PREFIX``: ``{"loaded": ...}``,
then one per call: the encoded result and the arguments as they were after the call
(mutations), or the exception the call raised. The workdir is read-only: nothing is
written to disk. Neither the tests nor the expected values
ever reach this process: the grader compares in its own process.

This file is copied into the sandbox: standard library only, nothing from the package.
"""

import json
import sys

#: Printed before anything of the candidate runs; the grader looks for it in the output.
HARNESS_MARKER = "composer-replication harness started"
#: Every report line starts with this (anything else the candidate prints is ignored).
RECORD_PREFIX = "@@composer-replication-result@@ "


def main() -> int:
    print(HARNESS_MARKER, flush=True)
    sys.path.insert(0, ".")
    import _plain

    with open("calls.json", encoding="utf-8") as fh:
        request = json.load(fh)
    out = sys.stdout

    def emit(record: dict) -> None:
        out.write("\n" + RECORD_PREFIX + json.dumps(record) + "\n")
        out.flush()

    try:
        import solution

        function = getattr(solution, request["entry_point"])
    except BaseException as exc:  # the candidate's own failure: reported, not raised
        emit({"loaded": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        return 0
    emit({"loaded": True})
    for call in request["calls"]:
        args = _plain.decode(call["args"])
        try:
            result = function(*args)
        except BaseException as exc:
            emit({"id": call["id"], "raised": type(exc).__name__, "message": str(exc)[:500]})
            continue
        try:
            record = {"id": call["id"], "result": _plain.encode(result)}
            record["args_after"] = _plain.encode(args)
        except (_plain.PlainDataError, RecursionError) as exc:
            record = {"id": call["id"], "unencodable": str(exc)[:500]}
        emit(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
