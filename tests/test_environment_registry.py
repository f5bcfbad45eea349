"""The built-in environments are declared once (``config.environments``): every place
that needs a fact about them reads it there, and each declared fact is true of the
environment class it names."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

from composer_replication.config.environments import (
    BUILTIN_ENVIRONMENTS,
    DEFAULT_EVAL_MAX_NEW_TOKENS,
    ENVIRONMENTS,
    builtin_environment,
    eval_max_new_tokens,
)


@pytest.mark.parametrize("name", BUILTIN_ENVIRONMENTS)
def test_each_declaration_is_true_of_its_class(name):
    env = ENVIRONMENTS[name]
    module_name, _, attr = env.cls.partition(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, attr)
    assert cls.name == name and env.module == module_name
    assert hasattr(module, "docker_sandbox_factory") is env.sandbox
    parameters = inspect.signature(cls).parameters
    assert "sandbox_factory" in parameters
    # an environment of repository tasks needs its task file (no default)
    task_file = parameters.get("task_file")
    assert (task_file is not None and task_file.default is inspect.Parameter.empty) is (
        env.repository_tasks
    )


def test_every_reader_takes_the_names_from_the_registry():
    from composer_replication.config.advantage import ENVS_WITHOUT_ROLE_ATTRIBUTION
    from composer_replication.config.sandbox import SANDBOX_ENVIRONMENTS
    from composer_replication.preflight import BUILTIN_ENVIRONMENTS as checked

    assert BUILTIN_ENVIRONMENTS == checked == ("python_functions", "feature_deletion")
    assert SANDBOX_ENVIRONMENTS == ("python_functions", "feature_deletion")
    assert set(ENVS_WITHOUT_ROLE_ATTRIBUTION) == {"python_functions"}
    assert builtin_environment("my_pkg.envs:make") is None
    assert eval_max_new_tokens("feature_deletion") == 256
    assert eval_max_new_tokens("python_functions") == DEFAULT_EVAL_MAX_NEW_TOKENS == 80
    assert eval_max_new_tokens("my_pkg.envs:make") == DEFAULT_EVAL_MAX_NEW_TOKENS


def test_an_unknown_name_is_one_line_listing_the_built_in_ones():
    from composer_replication.config.run import EnvConfig
    from composer_replication.envs import build_environment

    with pytest.raises(ValueError) as info:
        build_environment(EnvConfig(name="python_function"))
    assert str(info.value) == (
        "unknown environment 'python_function'; use python_functions, feature_deletion or "
        "'pkg.module:factory'"
    )


def test_repository_options_are_resolved_for_the_environments_that_take_them():
    from composer_replication.datagen.repository_tasks import resolve_repository_options

    kwargs = {"max_new_tokens": 8, "split": None, "tokenizer": None}
    options = {"repo": "smallkit", "task_file": "t.jsonl"}
    # an environment without repository tasks keeps its options as they are
    assert resolve_repository_options("python_functions", options, **kwargs) == options
    with pytest.raises(ValueError, match=r"^feature_deletion options name both repo and"):
        resolve_repository_options("feature_deletion", options, **kwargs)


def test_the_registry_is_importable_without_torch():
    code = (
        "import sys; import composer_replication.config.environments, "
        "composer_replication.config; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
