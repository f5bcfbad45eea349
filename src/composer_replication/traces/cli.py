"""Command-line front end of the trace pipeline: `ingest`, `replay`, `pairs`.

    ingest PATH -o states.jsonl            Claude Code sessions -> TraceState JSONL
    replay states.jsonl -o results.jsonl   teachers replay every state (spend-capped)
    pairs results.jsonl --states states.jsonl -o pairs.jsonl [--normalize]

`pairs` needs the states as well as the results: result rows carry only ids, not the
(large) state contexts, and the pairs need both the context and the student action.

Teachers for `replay` are either slugs of `DEFAULT_TEACHERS` separated by commas, or a
JSON / TOML file of `TeacherSpec`s (for any OpenAI-compatible endpoint): a JSON list, or
`{"teachers": [...]}`, or TOML `[[teachers]]` tables with `slug`, `input_per_mtok`,
`output_per_mtok` and optionally `base_url`, `api_key_env`, `model`, `extra_body`.

`app` is a Typer app with the three commands; `register(main_app)` adds them to another
app as top-level commands. Imports beyond typer happen inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from composer_replication.common.errors import command_group

__all__ = ["app", "ingest", "load_teachers", "pairs", "register", "replay"]

app = command_group(
    "trace", "Trace replay: ingest Claude Code sessions, replay them through teachers, make pairs."
)


def _fail(message: str, code: int = 1) -> typer.Exit:
    """One line on stderr and the exit: 1 when nothing was produced, 2 (``_usage``) for a
    bad option, input or output path (``composer_replication.common.outputs`` lists the codes)."""
    typer.echo(f"Error: {message}", err=True)
    return typer.Exit(code=code)


def _usage(message: str) -> typer.Exit:
    return _fail(message, code=2)


_FOLLOW = typer.Option(
    False, "--follow-symlinks", help="Write through an output that is a symbolic link."
)


def _output(output: Path, follow_symlinks: bool, *inputs: Path) -> Path:
    """The checked output file (the project's output policy), before any work starts;
    an input folder counts whole (its files are all read)."""
    from composer_replication.common.outputs import check_output

    return check_output(
        output,
        inputs=[p for p in inputs if not p.is_dir()],
        input_dirs=[p for p in inputs if p.is_dir()],
        follow_symlinks=follow_symlinks,
    )


# What each input row must hold (name -> type); other rows are skipped and counted.
_STATE_FIELDS = {"state_id": str, "messages": list, "student_action": str}
_RESULT_FIELDS = {"state_id": str}


def _read_rows(path: Path, fields: dict[str, type], what: str) -> list[dict[str, Any]]:
    """The well-formed rows of a JSONL input; bad lines and wrong-typed rows are counted
    and reported, never a traceback."""
    from composer_replication.traces.teacher_replay.pairs import read_jsonl

    skipped: dict[str, int] = {}
    rows = []
    for value in read_jsonl(path, skipped=skipped):
        if isinstance(value, dict) and all(isinstance(value.get(k), t) for k, t in fields.items()):
            rows.append(value)
        else:
            skipped["wrong_type"] = skipped.get("wrong_type", 0) + 1
    if skipped:
        listed = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(skipped.items()))
        typer.echo(f"{what}: skipped {sum(skipped.values())} lines ({listed})", err=True)
    return rows


def load_teachers(spec: str) -> list[dict[str, Any]]:
    """Teachers from comma-separated `DEFAULT_TEACHERS` slugs or a .json / .toml file."""
    from composer_replication.traces.teacher_replay.records import DEFAULT_TEACHERS

    path = Path(spec)
    if path.suffix.lower() in (".json", ".toml"):
        if not path.is_file():
            raise FileNotFoundError(f"teachers file {spec!r} does not exist")
        try:
            if path.suffix.lower() == ".json":
                data: Any = json.loads(path.read_text(encoding="utf-8"))
            else:
                try:
                    import tomllib
                except ModuleNotFoundError:  # Python 3.10
                    import tomli as tomllib  # type: ignore[no-redef]
                data = tomllib.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:  # not UTF-8, not JSON / TOML: name the file
            kind = path.suffix.lower().lstrip(".").upper()
            raise ValueError(f"teachers file {spec!r} is not valid {kind} ({exc})") from None
        teachers = data.get("teachers") if isinstance(data, dict) else data
        if not isinstance(teachers, list) or not all(isinstance(t, dict) for t in teachers):
            raise ValueError(
                f"{spec}: expected a list of teacher tables (JSON list, {{'teachers': [...]}} "
                "or TOML [[teachers]])"
            )
        return teachers
    known = {t["slug"]: dict(t) for t in DEFAULT_TEACHERS}
    slugs = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in slugs if s not in known]
    if unknown or not slugs:
        raise ValueError(
            f"unknown teacher slug(s) {unknown or spec!r}; use {', '.join(known)} or a "
            ".json/.toml file of TeacherSpecs"
        )
    return [known[s] for s in slugs]


@app.command()
def ingest(
    path: Path = typer.Argument(
        ..., help="A session .jsonl, a project folder, or ~/.claude/projects."
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the states (JSONL)."),
    max_history_tokens: Optional[int] = typer.Option(  # noqa: UP045 - typer needs Optional on 3.10
        None, min=1, help="Drop the oldest history beyond this many (estimated) tokens."
    ),
    keep_sidechain: bool = typer.Option(False, help="Also ingest subagent records and files."),
    keep_thinking: bool = typer.Option(False, help="Keep thinking blocks in the history."),
    follow_symlinks: bool = _FOLLOW,
) -> None:
    """Claude Code session files -> TraceState JSONL (one state per assistant turn)."""
    from composer_replication.traces.ingestion.claude_code import ClaudeCodeIngester
    from composer_replication.traces.teacher_replay.pairs import write_jsonl

    if not path.exists():
        raise _usage(f"input {str(path)!r} does not exist; pass a session .jsonl or a folder")
    try:
        target = _output(output, follow_symlinks, path)
    except ValueError as exc:
        raise _usage(str(exc)) from None

    ingester = ClaudeCodeIngester(
        skip_sidechain=not keep_sidechain,
        strip_thinking=not keep_thinking,
        max_history_tokens=max_history_tokens,
    )
    from composer_replication.traces.teacher_replay.pairs import EmptyOutputError

    try:
        write_jsonl(ingester.ingest(path), target, require_rows=True)
    except EmptyOutputError as exc:
        stats = ingester.last_stats
        raise _fail(
            f"{path} gave no states ({stats.n_records_total} records read, "
            f"{stats.n_records_skipped} skipped): nothing written, {output} left untouched"
        ) from exc
    except (FileNotFoundError, IsADirectoryError, PermissionError, ValueError) as exc:
        raise _usage(str(exc)) from exc
    s = ingester.last_stats
    typer.echo(
        f"ingested {s.n_files} file(s), {s.n_records_total} records: {s.n_states_emitted} states "
        f"({s.n_error_sites} after an error, {s.n_truncated_states} truncated) -> {output}"
    )
    skips = {
        "subagent": s.skipped_subagent,
        "subagent files": s.skipped_subagent_files,
        "summary": s.skipped_summary,
        "snapshot": s.skipped_snapshot,
        "truncated": s.skipped_truncated_lines,
        "malformed": s.skipped_malformed_lines,
        "unknown type": s.skipped_unknown_type,
        "oversized or too deep": s.skipped_oversized_lines,
        "other": s.skipped_other,
    }
    listed = ", ".join(f"{k} {v}" for k, v in skips.items() if v) or "none"
    typer.echo(f"skipped {s.n_records_skipped} records: {listed}")
    for warning in [*s.version_warnings, *s.warnings]:
        typer.echo(f"warning: {warning}")


@app.command()
def replay(
    states_path: Path = typer.Argument(..., help="States JSONL written by `ingest`."),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the result rows."),
    teachers: str = typer.Option(
        "anthropic/claude-opus-4.7,openai/gpt-5,deepseek/deepseek-v4-pro",
        help="Comma-separated DEFAULT_TEACHERS slugs, or a .json/.toml file of TeacherSpecs.",
    ),
    max_usd: float = typer.Option(
        5.0, min=0.0, help="Hard spend cap (USD); with a cache, over every run that used it."
    ),
    concurrency: int = typer.Option(16, min=1, help="Calls in flight at most."),
    cache_dir: Optional[Path] = typer.Option(  # noqa: UP045
        None, help="Row cache for resuming (default: <output>.cache next to the output)."
    ),
    no_cache: bool = typer.Option(False, help="Do not read or write the row cache."),
    max_tokens: int = typer.Option(2048, min=1, help="Completion cap per call."),
    timeout: float = typer.Option(120.0, min=0.001, help="Seconds allowed per HTTP attempt."),
    max_retries: int = typer.Option(4, min=0, help="Retries per call on transient errors."),
    resend_in_flight: bool = typer.Option(
        False, help="Send again calls a killed run left in flight (they may have been billed)."
    ),
    follow_symlinks: bool = _FOLLOW,
) -> None:
    """Replay every state through the teachers; rows keep state then teacher order."""
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from composer_replication.traces.teacher_replay.pairs import write_jsonl
    from composer_replication.traces.teacher_replay.replay import replay_trace

    try:  # everything that can fail is checked before the first paid call
        target = _output(output, follow_symlinks, states_path)
        states = _read_rows(states_path, _STATE_FIELDS, "states")
        teacher_specs = load_teachers(teachers)
        cache = None if no_cache else (cache_dir or target.with_name(target.name + ".cache"))
        if cache is not None:
            from composer_replication.common.outputs import check_output_dir

            check_output_dir(cache, option="--cache-dir")
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise _usage(str(exc)) from exc
    if not states:
        raise _fail(f"{states_path} holds no states: nothing to replay, {output} left untouched")
    columns = (
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("spend ${task.fields[spend]:.4f} / ${task.fields[cap]:g}"),
        TextColumn("errors {task.fields[errors]}"),
    )
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(
            "replay", total=len(states) * len(teacher_specs), spend=0.0, cap=max_usd, errors=0
        )

        def on_progress(p: Any) -> None:
            bar.update(task, completed=p.done, spend=p.spend_usd, errors=p.n_errors)

        try:
            rows = asyncio.run(
                replay_trace(
                    states,
                    teacher_specs,  # type: ignore[arg-type]
                    max_usd,
                    concurrency=concurrency,
                    cache_dir=cache,
                    max_tokens=max_tokens,
                    timeout_s=timeout,
                    max_retries=max_retries,
                    progress=on_progress,
                    resend_in_flight=resend_in_flight,
                )
            )
        except (RuntimeError, ValueError) as exc:  # checked before the first call
            raise _usage(str(exc)) from exc
    if rows and all(r["error"] is not None for r in rows):
        typer.echo(rows.summary.format(), err=True)
        raise _fail(
            f"every one of the {len(rows)} teacher calls failed (errors above): nothing "
            f"written, {output} left untouched"
        )
    write_jsonl(rows, target, require_rows=True)
    typer.echo(f"{len(states)} states x {len(teacher_specs)} teachers -> {output}")
    typer.echo(rows.summary.format())


@app.command()
def pairs(
    results_path: Path = typer.Argument(..., help="Result rows written by `replay`."),
    states_path: Path = typer.Option(..., "--states", help="The states JSONL the rows answer."),
    output: Path = typer.Option(..., "-o", "--output", help="Where to write the pairs (JSONL)."),
    threshold: int = typer.Option(2, min=1, help="Teachers that must agree for a pair."),
    normalize: bool = typer.Option(False, help="Normalise with data-juicer (replaysim extra)."),
    recipe: Optional[Path] = typer.Option(  # noqa: UP045
        None, help="data-juicer recipe for --normalize (default: the packaged recipe)."
    ),
    follow_symlinks: bool = _FOLLOW,
) -> None:
    """Teacher agreement against the student -> DPO pairs (optionally normalised)."""
    from composer_replication.traces.teacher_replay.pairs import extract_dpo_pairs, write_jsonl

    try:
        inputs = [results_path, states_path, *([recipe] if recipe else [])]
        target = _output(output, follow_symlinks, *inputs)
        states = _read_rows(states_path, _STATE_FIELDS, "states")
        rows = _read_rows(results_path, _RESULT_FIELDS, "results")
        normalizer = None
        if normalize:
            from composer_replication.traces.replaysim.normalize import DJNormalizer

            normalizer = DJNormalizer(recipe)
            if recipe is not None:
                _check_recipe(recipe)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as exc:
        raise _usage(str(exc)) from exc
    known = {st["state_id"] for st in states}
    if not any(r["state_id"] in known for r in rows):
        raise _fail(
            f"no result row of {results_path} answers a state of {states_path} (were they made "
            f"from different inputs?): nothing written, {output} left untouched"
        )
    found = extract_dpo_pairs(states, rows, threshold)
    n_errors = sum(r.get("error") is not None for r in rows)
    typer.echo(
        f"{len(states)} states, {len(rows)} rows ({n_errors} errors): {len(found)} pairs "
        f"with >= {threshold} teachers agreeing against the student"
    )
    if not found:
        raise _fail(f"no pairs to write: {output} left untouched")
    if normalizer is None:
        write_jsonl(found, target, require_rows=True)
        typer.echo(f"wrote {len(found)} pairs -> {output}")
        return
    try:
        normalized = normalizer.normalize(found)
    except SystemExit:  # data-juicer's config parser exits on what it cannot read
        raise _usage(f"data-juicer could not parse the recipe {recipe}; fix it") from None
    except Exception as exc:
        if type(exc).__module__.split(".")[0] not in ("data_juicer", "jsonargparse"):
            raise
        raise _usage(f"data-juicer recipe {recipe or 'packaged'}: {_dj_reason(exc)}") from None
    if not normalized:
        raise _fail(f"the recipe dropped every pair: {output} left untouched")
    write_jsonl((p.to_dict() for p in normalized), target, require_rows=True)
    st = normalizer.last_stats
    dropped = (
        f"{st.n_dropped_by_recipe} by the recipe, {st.n_dropped_identical} identical" if st else ""
    )
    typer.echo(f"wrote {len(normalized)} normalised pairs ({dropped}) -> {output}")


def _check_recipe(recipe: Path) -> None:
    """A data-juicer recipe is a YAML mapping with a ``process`` list (checked here, so the
    error names the file instead of surfacing data-juicer's parser text)."""
    import yaml

    shown = repr(str(recipe))
    try:
        data = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"data-juicer recipe {shown} is not text (not UTF-8)") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ValueError(f"data-juicer recipe {shown} is not valid YAML{line}") from None
    if not isinstance(data, dict) or not isinstance(data.get("process"), list):
        raise ValueError(
            f"data-juicer recipe {shown} has no 'process' list of operators; see the packaged "
            "recipe (leave out --recipe to use it)"
        )


def _dj_reason(exc: Exception) -> str:
    """The line of a data-juicer error that says what is wrong."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    marked = [line.lstrip("✗ ").strip() for line in lines if line.startswith("✗")]
    return (marked or lines or [type(exc).__name__])[0]


def register(main_app: typer.Typer) -> None:
    """Add `ingest`, `replay` and `pairs` to `main_app` as top-level commands."""
    for fn in (ingest, replay, pairs):
        main_app.command(fn.__name__)(fn)
