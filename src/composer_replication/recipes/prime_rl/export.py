"""Our run config as a PRIME-RL ``rl`` TOML (``composer-replication export prime-rl``).

One ``[[orchestrator.train.source]]`` per environment, each with its own ``algo`` table, and
``[trainer.loss] type = "custom"`` pointing at our loss
(:data:`~composer_replication.recipes.prime_rl.composer_loss.IMPORT_PATH`) with the run's
``[loss]`` knobs. PRIME-RL runs verifiers tasksets: each source names the taskset by our
environment's name, and a verifiers taskset of that id must exist on the PRIME-RL side.

The algorithms whose config declares the ``prime_rl`` backend (``backends``: grpo, max_rl,
opd, opsd, sft, echo) map onto PRIME-RL's algorithm tables here (opd: the teacher's
endpoint, sft: the frozen sampling source, echo: the role weights). The rest have no
PRIME-RL equivalent and are never dropped silently: :class:`UnsupportedAlgorithmError` lists
every environment that cannot be exported and why. ``drop_unsupported=True`` exports
``composer`` as its Dr.GRPO channel (``grpo``) and names what was dropped (a TOML comment
and a warning line).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from composer_replication.config.advantage import (
    BUILTIN_ADVANTAGES,
    DEFAULT_DEMO_TEMPLATE,
    ComposerAdvantage,
)
from composer_replication.config.references import (
    REFERENCE_SOLUTIONS,
    FrozenEndpoint,
    LocalFrozenModel,
)
from composer_replication.config.run import EnvConfig, RunConfig
from composer_replication.config.toml_writer import dumps, dumps_array_of_tables
from composer_replication.recipes.prime_rl.composer_loss import IMPORT_PATH

#: The algorithm types this export writes: those that declare the ``prime_rl`` backend.
PRIME_RL_TYPES = tuple(n for n, c in BUILTIN_ADVANTAGES.items() if "prime_rl" in c.backends)
#: The hub id of our embedded default policy (SmolLM2-135M-Instruct).
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: PRIME-RL's echo role table.
_ECHO_ROLES = ("system", "user", "assistant", "tool")
#: PRIME-RL's fixed ref_kl loss settings (mask_low, kl_tau), not configurable there.
_PRIME_RL_REF_KL = (0.2, 1e-3)

#: Why an algorithm without the ``prime_rl`` backend has no PRIME-RL form (the message).
_NO_EQUIVALENT = {
    "sdpo": "its jsd channel is a full-vocabulary JSD to the hinted policy; PRIME-RL's loss "
    "hook receives the sampled tokens' log-probs only, no logits",
    "replay_dpo": "trace-replay DPO needs chosen/rejected pairs; PRIME-RL's per-sample loss "
    "hook receives no pairs and no logits",
    "composer": "its jsd channel needs full-vocabulary logits and its trace-replay DPO "
    "channel needs pairs, neither of which PRIME-RL's loss hook receives (pass "
    "--drop-unsupported to export only its Dr.GRPO channel as grpo)",
    "reward": "PRIME-RL has no baseline-free algorithm (grpo subtracts the group mean); use "
    "type = 'grpo' or 'max_rl'",
    "custom": "PRIME-RL names credit-assignment schemes in code, not by import path; register "
    "the function as a PRIME-RL algorithm or use a built-in type",
}


class UnsupportedAlgorithmError(ValueError):
    """Environments whose algorithm (or a setting of it) PRIME-RL cannot express."""


@dataclass
class PrimeRLExport:
    """The TOML text and the warnings (what was dropped or must exist on the PRIME-RL side)."""

    toml: str
    warnings: list[str] = field(default_factory=list)


def _frozen(reference: Any, where: str, problems: list[str]) -> dict[str, Any] | None:
    """PRIME-RL's frozen model table ``{name, base_url[, api_key_var]}``."""
    if isinstance(reference, FrozenEndpoint):
        out: dict[str, Any] = {"name": reference.name, "base_url": reference.base_url}
        if reference.api_key_env:
            out["api_key_var"] = reference.api_key_env
        return out
    if isinstance(reference, LocalFrozenModel):
        problems.append(
            f"{where} is the local model {reference.local_path!r}, which has no endpoint; "
            "PRIME-RL reaches frozen models over HTTP only: serve it (e.g. vLLM) and give "
            "{name, base_url} instead"
        )
    if reference == REFERENCE_SOLUTIONS:
        problems.append(
            f"{where} is 'reference' (the environment's reference solutions); PRIME-RL's sft "
            "samples a frozen model over HTTP: give {name, base_url} instead"
        )
    return None


def _grpo(adv: Any, where: str, problems: list[str]) -> dict[str, Any]:
    if adv.std_normalize:
        problems.append(
            f"{where}: grpo with std_normalize = true; PRIME-RL's grpo subtracts the group mean "
            "only: set std_normalize = false"
        )
    if adv.length_penalty > 0:
        problems.append(
            f"{where}: grpo length_penalty = {adv.length_penalty} (over length_target) has no "
            "PRIME-RL form (its penalty is pass-rate scaled): set length_penalty = 0"
        )
    return {"type": "grpo"}


def _opd(adv: Any, where: str, problems: list[str]) -> dict[str, Any]:
    teacher = _frozen(adv.model, f"{where}: the opd teacher", problems)
    return {"type": "opd", "teacher": teacher}


def _opsd(adv: Any, where: str, problems: list[str]) -> dict[str, Any]:
    if adv.model != "policy":
        problems.append(
            f"{where}: opsd scored by the frozen model {adv.model.name!r}; PRIME-RL's opsd "
            "teacher is always the live policy: set advantage.model = 'policy' or use opd"
        )
    if adv.demo_template != DEFAULT_DEMO_TEMPLATE:
        problems.append(
            f"{where}: opsd demo_template is customised; PRIME-RL puts the demonstration in a "
            "leading system message with its own template: remove demo_template"
        )
    # Our demonstrations come from rollout.metadata['reference'] (or a better sibling).
    return {"type": "opsd", "demo_key": "reference"}


def _sft(env: EnvConfig, where: str, problems: list[str]) -> dict[str, Any]:
    adv = env.algorithm.advantage
    if adv.ce_weight != 1.0:
        problems.append(
            f"{where}: sft ce_weight = {adv.ce_weight}; PRIME-RL's sft weighs every token 1: "
            "set ce_weight = 1"
        )
    source = _frozen(env.algorithm.sampling.source, f"{where}: the sft sampling source", problems)
    return {"type": "sft", "sampling": {"source": source}}


def _echo(adv: Any, where: str, problems: list[str]) -> dict[str, Any]:
    unknown = sorted(set(adv.roles) - set(_ECHO_ROLES))
    if unknown:
        problems.append(
            f"{where}: echo roles {unknown}; PRIME-RL trains the roles {list(_ECHO_ROLES)} only"
        )
    if adv.filter is not None:
        problems.append(
            f"{where}: echo filter {adv.filter.import_path!r} masks our trajectory steps "
            "(a step's completion span holds the observations that answered it); PRIME-RL "
            "reads each step's prompt extension instead: remove the filter or port it"
        )
    roles = {
        role: {"alpha": weight.alpha}
        for role, weight in adv.roles.items()
        if role in _ECHO_ROLES and weight.alpha > 0
    }
    return {"type": "echo", "roles": roles}


_MAPPERS: dict[str, Callable[[EnvConfig, str, list[str]], dict[str, Any]]] = {
    "grpo": lambda env, where, problems: _grpo(env.algorithm.advantage, where, problems),
    "max_rl": lambda env, where, problems: {"type": "max_rl"},
    "opd": lambda env, where, problems: _opd(env.algorithm.advantage, where, problems),
    "opsd": lambda env, where, problems: _opsd(env.algorithm.advantage, where, problems),
    "sft": _sft,
    "echo": lambda env, where, problems: _echo(env.algorithm.advantage, where, problems),
}


def _algo(env: EnvConfig, where: str, drop: bool, problems: list[str], notes: list[str]) -> dict:
    adv = env.algorithm.advantage
    kind = adv.type
    if isinstance(adv, ComposerAdvantage) and drop:
        notes.append(
            f"{where}: composer exported as grpo (its Dr.GRPO channel); dropped the jsd channel "
            f"(alpha_sdpo = {adv.alpha_sdpo}) and the trace-replay DPO channel "
            f"(beta_replay = {adv.beta_replay}), which PRIME-RL's loss hook cannot compute"
        )
        return {"type": "grpo"}
    if "prime_rl" not in adv.backends:
        why = _NO_EQUIVALENT.get(
            kind,
            "it does not declare the prime_rl backend (a user's algorithm trains in the "
            "native loop only); train it with composer-replication train",
        )
        problems.append(f"{where}: algorithm {kind!r} has no PRIME-RL equivalent: {why}")
        return {}
    return _MAPPERS[kind](env, where, problems)


def _model_name(source: str) -> str:
    if source == "embedded":
        return EMBEDDED_HUB_ID
    if source.endswith(".gguf"):
        raise ValueError(
            f"model.source {source!r} is a GGUF file; PRIME-RL loads Hugging Face checkpoints: "
            "give a hub id or a local Hugging Face directory"
        )
    return source


def _check_loss(config: RunConfig, kinds: set[str], problems: list[str]) -> None:
    loss = config.loss
    ref_kl_settings = (loss.mask_low, loss.kl_tau, loss.coefficient("ref_kl"))
    if kinds & {"opd", "opsd"} and ref_kl_settings != (*_PRIME_RL_REF_KL, 1.0):
        problems.append(
            f"loss: opd/opsd train PRIME-RL's built-in ref_kl loss (mask_low 0.2, kl_tau "
            f"1e-3, weight 1), but this run has mask_low = {loss.mask_low}, kl_tau = "
            f"{loss.kl_tau}, coefficients.ref_kl = {loss.coefficient('ref_kl')}: use those "
            "values"
        )
    if kinds & {"sft", "echo"} and loss.coefficient("ce") != 1:
        problems.append(
            f"loss: coefficients.ce = {loss.coefficient('ce')}; PRIME-RL's ce component has "
            "weight 1: remove the coefficient"
        )
    if loss.type == "custom":
        problems.append(
            f"loss: type = 'custom' ({loss.import_path}); the export writes PRIME-RL's loss as "
            "this project's composer loss: run a custom rl loss with the native trainer"
        )
    if kinds & {"sft", "echo"} and loss.lm_ce_label_smoothing:
        problems.append(
            f"loss: lm_ce_label_smoothing = {loss.lm_ce_label_smoothing}; PRIME-RL's ce "
            "component has no label smoothing: remove it"
        )


def _optim(config: RunConfig, notes: list[str]) -> dict[str, Any]:
    """PRIME-RL's AdamW table; what it has no field for here is named in the notes."""
    optim = config.optim
    out: dict[str, Any] = {
        "lr": optim.lr,
        "weight_decay": optim.weight_decay,
        "betas1": optim.betas[0],
        "betas2": optim.betas[1],
        "max_norm": optim.grad_clip,
    }
    if optim.grad_clip is None:
        notes.append("optim.grad_clip = null: PRIME-RL's default max_norm (1.0) applies")
    if optim.schedule != "constant" or optim.warmup_steps:
        notes.append(
            f"optim.schedule = {optim.schedule!r}, warmup_steps = {optim.warmup_steps} are not "
            "exported: set PRIME-RL's [trainer.scheduler] yourself"
        )
    return out


def _loss_kwargs(config: RunConfig) -> dict[str, float]:
    loss = config.loss
    # The rl coefficient scales the whole rl mean, i.e. both of its terms.
    scale = loss.coefficient("rl")
    return {
        "dppo_mask_high": loss.mask_high,
        "dppo_mask_low": loss.mask_low,
        "adv_tau": loss.adv_tau * scale,
        "kl_tau": loss.kl_tau * scale,
    }


def export_run_config(
    config: RunConfig, *, seq_len: int = 2048, drop_unsupported: bool = False
) -> PrimeRLExport:
    """The PRIME-RL ``rl`` TOML of ``config``.

    Raises :class:`UnsupportedAlgorithmError` listing every environment (and setting) that
    PRIME-RL cannot express; with ``drop_unsupported``, ``composer`` becomes ``grpo`` and
    the dropped channels are named in the result's warnings and in a TOML comment.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len = {seq_len} must be >= 1 (prompt + completion tokens)")
    problems: list[str] = []
    notes: list[str] = []
    sources, algos = [], []
    for env in config.envs:  # names are unique (RunConfig checks)
        where = f"environment {env.name!r}"
        sampling = env.algorithm.sampling
        if sampling.temperature > 2.0:
            problems.append(
                f"{where}: temperature = {sampling.temperature}; PRIME-RL samples at 0..2"
            )
        if sampling.max_new_tokens >= seq_len:
            problems.append(
                f"{where}: max_new_tokens = {sampling.max_new_tokens} leaves no room for the "
                f"prompt in seq_len = {seq_len}: raise --seq-len"
            )
        algo = _algo(env, where, drop_unsupported, problems, notes)
        algos.append(algo)
        if env.options:
            notes.append(
                f"{where}: options {sorted(env.options)} are not exported; configure the "
                "verifiers taskset on the PRIME-RL side"
            )
        sources.append(
            {
                "name": env.name,
                "group_size": sampling.group_size,
                # Relative weight: the environment's share of each step's rollouts.
                "ratio": float(env.tasks_per_step * sampling.group_size),
                "env": {"taskset": {"id": env.name}},
                "sampling": {
                    "temperature": sampling.temperature,
                    "max_completion_tokens": sampling.max_new_tokens,
                },
                "algo": algo,
            }
        )
    _check_loss(config, {a.get("type", "") for a in algos}, problems)
    if problems:
        raise UnsupportedAlgorithmError(
            "cannot export to PRIME-RL:\n" + "\n".join(f"- {p}" for p in problems)
        )
    first = config.envs[0].algorithm.sampling
    document: dict[str, Any] = {
        "max_steps": config.steps,
        "seq_len": seq_len,
        "model": {"name": _model_name(config.model.source)},
        "orchestrator": {
            "batch_size": sum(
                e.tasks_per_step * e.algorithm.sampling.group_size for e in config.envs
            ),
            "group_size": first.group_size,
            "algo": algos[0],
        },
        "trainer": {
            "optim": _optim(config, notes),
            "loss": {"type": "custom", "import_path": IMPORT_PATH, "kwargs": _loss_kwargs(config)},
        },
    }
    lora = config.model.lora
    if lora is not None:
        document["trainer"]["model"] = {
            "lora": {
                "rank": lora.r,
                "alpha": float(lora.alpha),
                "dropout": lora.dropout,
                "target_modules": list(lora.target_modules),
            }
        }
    header = [
        "# PRIME-RL rl config exported by composer-replication (run: uv run rl @ this file).",
        "# Each [[orchestrator.train.source]] names a verifiers taskset by our environment's",
        "# name (env.taskset.id): a verifiers taskset of that id must exist on the PRIME-RL side.",
        f"# [trainer.loss] imports {IMPORT_PATH}: install composer-replication there.",
    ]
    header += [f"# NOTE: {note}" for note in notes]
    text = "\n".join(header) + "\n\n" + dumps(document)
    text += "\n" + dumps_array_of_tables(["orchestrator", "train", "source"], sources)
    return PrimeRLExport(toml=text, warnings=notes)
