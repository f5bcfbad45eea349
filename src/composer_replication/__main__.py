"""``python -m composer_replication ...`` is the ``composer-replication`` command (what
``torchrun -m composer_replication train CONFIG`` runs on every rank)."""

from composer_replication.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
