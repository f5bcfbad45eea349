"""The trace pipeline, under one roof: real agent traces -> teacher replay -> DPO pairs.

- :mod:`.ingestion`: Claude Code JSONL sessions -> ``TraceState`` (one per assistant turn);
- :mod:`.teacher_replay`: each state replayed through several teacher models over any
  OpenAI-compatible endpoint (bounded concurrency, spend cap, resumable cache), and
  ``extract_dpo_pairs`` where teachers agree against the student;
- :mod:`.replaysim`: pairs normalised into chat records with a data-juicer recipe;
- :mod:`.cli`: ``composer-replication ingest / replay / pairs``.

The first public paths (``composer_replication.ingestion``, ``.teacher_replay``,
``.replaysim``, ``.trace_cli``) import these same modules.
"""
