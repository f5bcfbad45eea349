"""The trl backend and the PRIME-RL export read an algorithm's declarations (``backends``,
``trains``), never its name: what each runs is what the configs declare, a user's algorithm
is refused in one line naming it, and the trl trainer gets every loss setting from the
run's ``[loss]``."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

from composer_replication.config import LossConfig, RunConfig
from composer_replication.config.advantage import BUILTIN_ADVANTAGES

sys.path.insert(0, str(Path(__file__).parent))

USER_TYPE = "example_user_algorithm:LeaveOneOut"


def _run(advantage: str, loss: str = "") -> RunConfig:
    return RunConfig.from_toml(
        f'[loss]\n{loss}\n[[envs]]\nname = "python_functions"\n'
        f"[envs.algorithm.advantage]\n{advantage}\n"
    )


def test_the_trl_backend_runs_what_declares_it():
    from composer_replication.backends.trl.run import _composer_settings

    runs = [n for n, c in BUILTIN_ADVANTAGES.items() if "trl" in c.backends]
    assert runs == ["grpo", "sdpo", "composer"]
    for name in ("max_rl", "reward", "replay_dpo"):  # no trl backend declared
        with pytest.raises(ValueError) as info:
            _composer_settings(_run(f'type = "{name}"'))
        assert str(info.value) == (
            f"the trl backend runs the grpo, sdpo, composer algorithms, not {name!r}; use "
            "--backend native for it"
        )
    with pytest.raises(ValueError, match=rf"not '{USER_TYPE}'; use --backend native"):
        _composer_settings(_run(f'type = "{USER_TYPE}"'))


def test_the_trl_trainer_gets_every_loss_setting_from_the_run():
    from composer_replication.backends.trl.run import (
        TRAINER_LOSS_SETTINGS,
        TRL_APPLIED_LOSS_SETTINGS,
        _composer_settings,
    )
    from composer_replication.backends.trl.trainer import ComposerReplicationTrainer

    # the names are the trainer's keyword arguments and LossConfig's fields alike
    parameters = {
        name
        for name, p in inspect.signature(ComposerReplicationTrainer.__init__).parameters.items()
        if p.kind is p.KEYWORD_ONLY
    }
    assert set(TRAINER_LOSS_SETTINGS) == set(parameters) & set(LossConfig.model_fields)
    assert set(TRAINER_LOSS_SETTINGS) <= TRL_APPLIED_LOSS_SETTINGS
    tuned = "sdpo_jsd_beta = 0.25\nreplay_dpo_beta = 0.3\nsimpo_gamma = 0.5"
    for advantage in ('type = "grpo"', 'type = "sdpo"', 'type = "composer"'):
        settings = _composer_settings(_run(advantage, tuned))
        loss = _run(advantage, tuned).loss
        assert {n: settings[n] for n in TRAINER_LOSS_SETTINGS} == {
            n: getattr(loss, n) for n in TRAINER_LOSS_SETTINGS
        }
        assert (settings["sdpo_jsd_beta"], settings["replay_dpo_beta"]) == (0.25, 0.3)
    # a channel the algorithm does not train is off; one it trains has its config's weight
    grpo = _composer_settings(_run('type = "grpo"'))
    assert (grpo["alpha_sdpo"], grpo["beta_replay"]) == (0.0, 0.0) and "hint_fn" not in grpo
    sdpo = _composer_settings(_run('type = "sdpo"\nalpha_sdpo = 0.7'))
    assert (sdpo["alpha_sdpo"], sdpo["beta_replay"]) == (0.7, 0.0)
    composer = _composer_settings(_run('type = "composer"'))
    assert (composer["alpha_sdpo"], composer["beta_replay"]) == (0.1, 0.05)


def test_the_prime_rl_export_writes_what_declares_it():
    from composer_replication.recipes.prime_rl.export import (
        _MAPPERS,
        PRIME_RL_TYPES,
        UnsupportedAlgorithmError,
        export_run_config,
    )

    declared = {n for n, c in BUILTIN_ADVANTAGES.items() if "prime_rl" in c.backends}
    assert set(PRIME_RL_TYPES) == set(_MAPPERS) == declared
    with pytest.raises(UnsupportedAlgorithmError) as info:
        export_run_config(_run(f'type = "{USER_TYPE}"'))
    assert str(info.value).splitlines()[1] == (
        f"- environment 'python_functions': algorithm '{USER_TYPE}' has no PRIME-RL "
        "equivalent: it does not declare the prime_rl backend (a user's algorithm trains in "
        "the native loop only); train it with composer-replication train"
    )
