"""Every python example of docs/API_REFERENCE.md runs as written.

Each fenced block whose info string starts with ``python`` is an example; it runs in a fresh
process (``doc_examples_runner.py``: forked from one warm parent) in its own temporary
directory, under a timeout. Examples that need a cloud account talk to the suite's local
stand-in: a moto server answers every AWS call (``AWS_ENDPOINT_URL``, dummy credentials),
so the SageMaker and S3 examples run unchanged. A block that cannot run here says why in
its info string, ```` ```python no-run: needs a GPU ````, and is reported as skipped with
that reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "API_REFERENCE.md"
RUNNER = Path(__file__).resolve().parent / "doc_examples_runner.py"
TIMEOUT_S = 60  # one example; the whole file stays well under 90 s
FENCE = re.compile(r"^```(\S*)(.*)$")


@dataclass(frozen=True)
class Example:
    line: int  # of the opening fence, 1-based
    heading: str
    info: str
    code: str

    @property
    def id(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9_.]+", "-", self.heading).strip("-")[:60]
        return f"L{self.line}-{slug}"

    @property
    def skip_reason(self) -> str | None:
        match = re.match(r"python\s+no-run:\s*(.+)$", self.info)
        return match.group(1).strip() if match else None


def extract_examples(text: str) -> list[Example]:
    """The python code blocks of a markdown text, with their info strings and headings."""
    examples, heading, block, start, info = [], "", None, 0, ""
    for number, line in enumerate(text.splitlines(), start=1):
        if block is None:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            match = FENCE.match(line)
            if match:
                block, start, info = [], number, (match.group(1) + match.group(2)).strip()
            continue
        if line.startswith("```"):
            if info.split()[:1] == ["python"]:
                examples.append(Example(start, heading, info, "\n".join(block) + "\n"))
            block = None
            continue
        block.append(line)
    if block is not None:
        raise ValueError(f"{DOC.name}:{start}: a code fence is never closed")
    return examples


EXAMPLES = extract_examples(DOC.read_text(encoding="utf-8"))


def test_the_reference_has_examples_and_each_skip_gives_a_reason():
    assert len(EXAMPLES) >= 40
    for example in EXAMPLES:
        if example.info != "python":
            assert example.skip_reason, f"{example.id}: write ```python or ```python no-run: why"


def test_extraction_reads_info_strings_and_headings():
    text = (
        "# A\n```python\nx = 1\n```\n## B\n```python no-run: needs a GPU\ny\n```\n```text\nz\n```\n"
    )
    first, second = extract_examples(text)
    assert (first.heading, first.code, first.skip_reason) == ("A", "x = 1\n", None)
    assert (second.heading, second.skip_reason, second.line) == ("B", "needs a GPU", 6)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Every runnable example's result, from one runner process."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    with _moto_server() as endpoint:
        env.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_SESSION_TOKEN="testing",
            AWS_DEFAULT_REGION="us-east-1",
        )
        spec = {
            "timeout_s": TIMEOUT_S,
            "examples": [
                {"id": e.id, "code": e.code, "filename": f"{DOC.name}:{e.line}"}
                for e in EXAMPLES
                if e.skip_reason is None
            ],
        }
        done = subprocess.run(
            [sys.executable, str(RUNNER)],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path_factory.mktemp("examples"),
            timeout=TIMEOUT_S * len(spec["examples"]),
            check=False,
        )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


class _moto_server:
    """A moto server on loopback (S3, SageMaker, CloudWatch Logs, ...) for the cloud
    examples; no server (and no endpoint) when moto is not installed."""

    def __enter__(self) -> str:
        try:
            from moto.server import ThreadedMotoServer
        except ImportError:
            self.server = None
            return ""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.id)
def test_documented_example_runs(example: Example, request):
    if example.skip_reason is not None:
        pytest.skip(example.skip_reason)
    result = request.getfixturevalue("results")[example.id]
    assert result["status"] == "passed", (
        f"{DOC.name}:{example.line} ({example.heading}) {result['status']}:\n{result['output']}"
    )
