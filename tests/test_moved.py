"""Module paths that are not where the code lives: the seed API's paths are the same module
objects, silently and for good; earlier paths of moved modules are the same objects with a
DeprecationWarning naming the new path on the first import of each, and a removal release
after this one."""

from __future__ import annotations

import json
import subprocess
import sys

from packaging.version import Version

import composer_replication
from composer_replication._moved import MOVED, REMOVED_IN, SEED_PATHS, current_name, deprecated

# In a fresh interpreter (a module imports once per process): import every old path, and
# a submodule below an old package, twice each; report the warnings of each import.
PROBE = """
import importlib, json, sys, warnings
from composer_replication._moved import MOVED, SEED_PATHS

paths = [*MOVED, *SEED_PATHS, "composer_replication.teacher_replay.replay"]
report = []
for old in paths:
    for attempt in (1, 2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        report.append({
            "old": old,
            "attempt": attempt,
            "module": module.__name__,
            "warnings": [(w.category.__name__, str(w.message)) for w in caught],
        })
print(json.dumps(report))
"""


def test_current_name_follows_packages_and_leaves_other_paths_alone():
    assert current_name("composer_replication.ingestion") == "composer_replication.traces.ingestion"
    assert (
        current_name("composer_replication.teacher_replay.replay")
        == "composer_replication.traces.teacher_replay.replay"
    )
    assert current_name("composer_replication.ingestionx") is None
    assert current_name("composer_replication.traces.ingestion") is None


def test_the_old_paths_go_in_the_next_minor_release():
    current = Version(composer_replication.__version__)
    assert Version(REMOVED_IN) == Version(f"{current.major}.{current.minor + 1}.0")


def test_each_path_is_the_new_module_and_only_moved_paths_warn_once_naming_it():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=300
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report) == 2 * (len(MOVED) + len(SEED_PATHS) + 1)
    for entry in report:
        new = current_name(entry["old"])
        assert entry["module"] == new  # the module object of the new path itself
        if entry["attempt"] == 2 or not deprecated(entry["old"]):
            assert entry["warnings"] == [], entry
        else:
            assert entry["warnings"] == [
                [
                    "DeprecationWarning",
                    f"{entry['old']} is deprecated and will be removed in "
                    f"composer-replication {REMOVED_IN}; import {new} instead",
                ]
            ], entry


def test_the_seed_path_of_the_data_collator_is_the_trl_backends_collator():
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "from composer_replication.trainer import data_collator as seed\n"
        "from composer_replication.backends.trl import data_collator as backend\n"
        "assert all(getattr(seed, n) is getattr(backend, n) for n in seed.__all__)\n"
        "assert set(seed.__all__) >= {'CollatorConfig', 'ComposerDataCollator', 'TraceExample',"
        " 'TraceTurn', 'TokenizerLike'}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
