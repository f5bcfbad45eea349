"""One pydantic config per algorithm, discriminated on ``type``.

The defaults of each class ARE the algorithm's vetted setting. ``AdvantageConfig`` is the
discriminated union that ``AlgorithmConfig.advantage`` holds: a built-in ``type``, or a
user's algorithm by import path (``type = "package.module:Class"``, an ``Algorithm``
subclass whose ``config_class`` is a :class:`UserAdvantage` subclass holding its options).

What an algorithm is, each class declares once (class variables, read by the config's
validation, the trl backend and the PRIME-RL export; ``Algorithm`` subclasses take their
``components`` from them): ``trains`` (the loss components it sets weights on; ``rl``
needs the sampler's log-probs of the policy), ``group_relative`` (a group of one gives
zero advantage), ``backends`` (where it can train: ``native`` always, ``trl``,
``prime_rl``) and ``model_slot`` (where a top-level ``model`` shorthand lands).

Knob names are the ones the seed API gives the same knobs (``alpha_sdpo``, ``beta_replay``,
``sdpo_jsd_beta``, ``replay_dpo_beta``, ``dpo_variant``); the old spellings (``alpha``,
``beta``, ``jsd_beta``, ``dpo_beta``, ``loss``, ``weight``) still parse, with a
:class:`~composer_replication.config.deprecation.ConfigDeprecationWarning`. Loss settings an
algorithm declares (``sdpo_jsd_beta``, ``replay_dpo_beta``, ``dpo_variant``; None = no
requirement) are requirements on the run's ``[loss]`` table: see :meth:`loss_requirements`.
"""

from __future__ import annotations

import difflib
import re
import sys
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializeAsAny,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from composer_replication.config.deprecation import rename_deprecated
from composer_replication.config.environments import ENVIRONMENTS
from composer_replication.config.references import ModelReference

#: Teacher-context templates: the last user message, rewritten around a hint / a demo.
DEFAULT_HINT_TEMPLATE = "{content}\n\nHint: {hint}"
DEFAULT_DEMO_TEMPLATE = "{content}\n\nHere is a correct solution, for reference:\n{demonstration}"

#: What an ``import_path`` setting must look like ('package.module:function').
IMPORT_PATH_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
_IMPORT_PATH = IMPORT_PATH_PATTERN

#: Where an algorithm can train: the native loop (every algorithm), ``train --backend trl``
#: and ``export prime-rl``.
BACKENDS = ("native", "trl", "prime_rl")


#: Old names whose meaning differed between algorithms: refused with what to write instead.
RETIRED_NAMES: dict[str, str] = {
    "beta": "it meant replay_dpo_beta under replay_dpo but beta_replay under composer; write "
    "replay_dpo_beta (the DPO beta) or beta_replay (the weight of each pair)",
}


class _Advantage(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    #: The loss components its samples carry weights for (``COMPONENTS`` names).
    trains: ClassVar[tuple[str, ...]] = ()
    #: Its advantage is relative to the group: a group of one gives all zeros.
    group_relative: ClassVar[bool] = False
    #: Where it can train (``BACKENDS``; ``native`` always).
    backends: ClassVar[frozenset[str]] = frozenset({"native"})
    #: Where the top-level ``model`` shorthand lands ("advantage.model" or
    #: "sampling.source"); None: it takes none.
    model_slot: ClassVar[str | None] = None
    #: Old field name -> current name, per class.
    renames: ClassVar[dict[str, str]] = {}
    #: Fields that are requirements on the run's loss settings (same names as LossConfig).
    loss_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        unknown = sorted(set(cls.backends) - set(BACKENDS))
        if unknown or "native" not in cls.backends:
            raise TypeError(
                f"{cls.__name__}.backends = {sorted(cls.backends)}: declare some of {BACKENDS}, "
                "'native' always"
            )
        if isinstance(cls.trains, str) or not all(
            isinstance(c, str) and c.isidentifier() for c in cls.trains
        ):
            raise TypeError(
                f"{cls.__name__}.trains = {cls.trains!r}: declare a tuple of loss component "
                "names, e.g. ('rl',)"
            )

    @classmethod
    def needs_policy_logprobs(cls) -> bool:
        """It trains ``rl``, whose importance ratio needs the policy's sampling log-probs."""
        return "rl" in cls.trains

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data: Any) -> Any:
        kind = data.get("type", "") if isinstance(data, dict) else ""
        where = f"advantage ({kind or cls.__name__})"
        if isinstance(data, dict):
            for old, why in RETIRED_NAMES.items():
                if old in data:
                    raise ValueError(f"{where}: {old} = {data[old]!r} is retired: {why}")
        return rename_deprecated(data, cls.renames, where)

    def loss_requirements(self) -> dict[str, Any]:
        """The loss settings this algorithm's samples need (unset fields: none)."""
        return {k: getattr(self, k) for k in self.loss_fields if getattr(self, k) is not None}

    @property
    def teacher_mode(self) -> tuple[str, float] | None:
        """``(mode, ema_decay)`` of the jsd teacher model, or None without a jsd channel."""
        return None

    def check_environment(self, env_name: str) -> None:
        """Raise ``ValueError`` if environment ``env_name`` cannot feed this algorithm."""


class _TurnShaping(_Advantage):
    """Per-turn reward shaping of agent episodes, for the group-relative algorithms."""

    turn_reward_weight: float = Field(
        0.0,
        ge=0,
        description="Per-turn rewards of agent episodes: each turn that changed the repository "
        "and was followed by a test run adds this weight times the change in the share of the "
        "task's target tests that run saw passing (against the run before; 0 at the start) to "
        "the advantage of its tokens. 0: the episode's reward alone.",
    )


class GRPOAdvantage(_TurnShaping):
    """Dr.GRPO (arXiv 2503.20783): ``A = r - mean(r)`` over the group, on sampled tokens."""

    trains: ClassVar[tuple[str, ...]] = ("rl",)
    group_relative: ClassVar[bool] = True
    backends: ClassVar[frozenset[str]] = frozenset({"native", "trl", "prime_rl"})

    type: Literal["grpo"] = Field("grpo", description="Algorithm name.")
    std_normalize: bool = Field(
        False, description="Divide by the group's sample std + eps (classic GRPO, 2402.03300)."
    )
    eps: float = Field(1e-6, gt=0, description="Epsilon of the std division.")
    length_penalty: float = Field(
        0.0,
        ge=0,
        description="Coefficient c of the reward penalty c * max(0, L - length_target) / "
        "length_target, L = sampled tokens; 0 disables it.",
    )
    length_target: int | None = Field(
        None, ge=1, description="Length (sampled tokens) above which the penalty grows."
    )

    @model_validator(mode="after")
    def _penalty_needs_target(self) -> GRPOAdvantage:
        if self.length_penalty > 0 and self.length_target is None:
            raise ValueError(
                f"length_penalty = {self.length_penalty} needs length_target (the sampled-token "
                "count above which completions are penalised); set advantage.length_target"
            )
        return self


class MaxRLAdvantage(_TurnShaping):
    """MaxRL (arXiv 2602.02710): ``A = (r - mean) / (mean + eps)``, 0 when mean <= 0."""

    trains: ClassVar[tuple[str, ...]] = ("rl",)
    group_relative: ClassVar[bool] = True
    backends: ClassVar[frozenset[str]] = frozenset({"native", "prime_rl"})

    type: Literal["max_rl"] = Field("max_rl", description="Algorithm name.")
    eps: float = Field(1e-6, gt=0, description="Epsilon of the mean division.")


class RewardAdvantage(_Advantage):
    """``A = r``: the raw reward, no baseline (REINFORCE)."""

    trains: ClassVar[tuple[str, ...]] = ("rl",)

    type: Literal["reward"] = Field("reward", description="Algorithm name.")


class CustomAdvantage(_Advantage):
    """A user function ``fn(group, **kwargs) -> list[list[float]]`` of per-token advantages."""

    trains: ClassVar[tuple[str, ...]] = ("rl",)

    type: Literal["custom"] = Field("custom", description="Algorithm name.")
    import_path: str = Field(
        pattern=_IMPORT_PATH,
        description="'package.module:function'; one list per rollout, one value per "
        "completion token.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the function."
    )


class OPDAdvantage(_Advantage):
    """On-policy distillation: reverse KL to a frozen teacher's prefill log-probs."""

    trains: ClassVar[tuple[str, ...]] = ("ref_kl",)
    backends: ClassVar[frozenset[str]] = frozenset({"native", "prime_rl"})
    model_slot: ClassVar[str | None] = "advantage.model"

    type: Literal["opd"] = Field("opd", description="Algorithm name.")
    model: ModelReference | None = Field(
        None, description="The frozen teacher (endpoint or local model); 'policy' is rejected."
    )

    @field_validator("model")
    @classmethod
    def _not_policy(cls, value: Any) -> Any:
        if value == "policy":
            raise ValueError(
                "opd against 'policy' is degenerate: the KL of the policy to itself is 0 and "
                "nothing trains; set advantage.model to a frozen teacher "
                "{name, base_url} / {name, local_path}, or use type = 'opsd' (the policy "
                "behind a demonstration)"
            )
        return value


class OPSDAdvantage(_Advantage):
    """On-policy self-distillation (SDFT setting): the reference scores the sample behind a
    demonstration (a successful sibling's completion or ``rollout.metadata['reference']``)."""

    trains: ClassVar[tuple[str, ...]] = ("ref_kl",)
    backends: ClassVar[frozenset[str]] = frozenset({"native", "prime_rl"})
    model_slot: ClassVar[str | None] = "advantage.model"

    type: Literal["opsd"] = Field("opsd", description="Algorithm name.")
    model: ModelReference = Field(
        "policy", description="Who scores the demo-conditioned context (default: the policy)."
    )
    demo_template: str = Field(
        DEFAULT_DEMO_TEMPLATE,
        description="Last user message of the reference context; placeholders {content} "
        "(the original message) and {demonstration}.",
    )

    @field_validator("demo_template")
    @classmethod
    def _placeholders(cls, value: str) -> str:
        missing = [p for p in ("{content}", "{demonstration}") if p not in value]
        if missing:
            raise ValueError(f"demo_template {value!r} lacks the placeholder(s) {missing}")
        return value


class _SelfDistillation(_TurnShaping):
    """Fields shared by the algorithms with an SDPO ``jsd`` channel."""

    teacher: Literal["policy", "initial", "ema"] = Field(
        "policy",
        description="Model behind the hinted context: live policy, frozen initial policy, "
        "or an EMA of the policy.",
    )
    ema_decay: float = Field(0.99, ge=0, lt=1, description="EMA decay (teacher = 'ema').")
    sdpo_jsd_beta: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Required loss.sdpo_jsd_beta (JSD mixture: 0 forward KL, 1 reverse KL); "
        "null: the run's loss setting (0.5 by default).",
    )
    use_sibling_demos: bool = Field(
        True, description="Use a better sibling's completion as the demonstration when one exists."
    )
    use_reference_demos: bool = Field(
        False,
        description="Without a better sibling, use the task's reference solution as the "
        "demonstration (environments that provide one, e.g. python_functions); else a hint.",
    )
    hint_source: Literal["generator", "feedback", "none"] = Field(
        "generator",
        description="Hint at error sites without a demonstration: 'generator' "
        "(hint_generator on the feedback), 'feedback' (the raw feedback), 'none'.",
    )

    @property
    def teacher_mode(self) -> tuple[str, float]:
        return self.teacher, self.ema_decay


class SDPOAdvantage(_SelfDistillation):
    """SDPO (arXiv 2601.20802): Dr.GRPO on every rollout + JSD to the hinted policy at error
    sites."""

    trains: ClassVar[tuple[str, ...]] = ("rl", "jsd")
    group_relative: ClassVar[bool] = True
    backends: ClassVar[frozenset[str]] = frozenset({"native", "trl"})

    renames: ClassVar[dict[str, str]] = {"alpha": "alpha_sdpo", "jsd_beta": "sdpo_jsd_beta"}
    loss_fields: ClassVar[tuple[str, ...]] = ("sdpo_jsd_beta",)

    type: Literal["sdpo"] = Field("sdpo", description="Algorithm name.")
    alpha_sdpo: float = Field(
        1.0, ge=0, description="jsd weight on an error site's sampled tokens (the SDPO weight)."
    )


class SFTAdvantage(_Advantage):
    """Cross-entropy on tokens sampled from a frozen source (teacher distillation)."""

    trains: ClassVar[tuple[str, ...]] = ("ce",)
    backends: ClassVar[frozenset[str]] = frozenset({"native", "prime_rl"})
    model_slot: ClassVar[str | None] = "sampling.source"

    type: Literal["sft"] = Field("sft", description="Algorithm name.")
    ce_weight: float = Field(1.0, gt=0, description="ce weight on each sampled token.")


class RoleWeight(BaseModel):
    """Weight of one message role's observation tokens in the ``ce`` component."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    alpha: float = Field(ge=0, description="ce weight on each token of this role.")


#: Built-in environments whose rollouts carry no per-token roles (``Rollout.token_roles``):
#: single-turn, every completion token is sampled, so there is no observation for echo's ce.
ENVS_WITHOUT_ROLE_ATTRIBUTION = frozenset(
    name for name, env in ENVIRONMENTS.items() if not env.role_attribution
)


class EchoFilter(BaseModel):
    """The optional echo filter: ``filter_fn(rollout, **kwargs) -> list[list[bool]]``.

    Called once per rollout; it returns one keep-mask per trajectory step
    (``Rollout.trajectory``), each spanning that step's ``prompt_ids + completion_ids``.
    False leaves the observation tokens of that step's completion out of ``ce`` (rl credit
    is never filtered).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    import_path: str = Field(
        pattern=_IMPORT_PATH, description="'package.module:function' of the filter."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the filter."
    )


class EchoAdvantage(_TurnShaping):
    """Dr.GRPO on actions + weighted CE on environment-observation tokens, per role.

    The observation tokens are found by role (``Rollout.token_roles``, the environment's
    role attribution), so echo needs an environment that attributes roles (multi-turn tool
    use: ``feature_deletion`` or an agent environment built on ``run_agent_rollouts``) and
    at least one role with a positive ``alpha``; otherwise ``ce`` would train nothing, and
    that is rejected at validation instead of running as plain grpo.
    """

    trains: ClassVar[tuple[str, ...]] = ("rl", "ce")
    group_relative: ClassVar[bool] = True
    backends: ClassVar[frozenset[str]] = frozenset({"native", "prime_rl"})

    type: Literal["echo"] = Field("echo", description="Algorithm name.")
    roles: dict[str, RoleWeight] = Field(
        default_factory=lambda: {"tool": RoleWeight(alpha=0.1), "user": RoleWeight(alpha=0.1)},
        description="Observation roles trained with ce, and their weights (at least one > 0): "
        "tool (a tool's output), user (a user turn, or a tool's output under a chat template "
        "without a tool role).",
    )
    filter: EchoFilter | None = Field(
        None,
        description="Optional keep masks per rollout: {import_path, kwargs}, "
        "fn(rollout, **kwargs) -> list[list[bool]], one mask per trajectory step over its "
        "prompt + completion (a bare import path is shorthand for {import_path = ...}); False "
        "leaves that step's observation tokens out of ce (rl credit stays).",
    )

    @field_validator("filter", mode="before")
    @classmethod
    def _filter_shorthand(cls, value: Any) -> Any:
        return {"import_path": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _some_role_trains(self) -> EchoAdvantage:
        if not any(weight.alpha > 0 for weight in self.roles.values()):
            listed = {role: weight.alpha for role, weight in self.roles.items()}
            raise ValueError(
                f"echo with advantage.roles = {listed} weights no observation token, so its ce "
                "trains nothing: give at least one role a positive alpha (e.g. "
                "advantage.roles.tool.alpha = 0.1, the default), or use type = 'grpo'"
            )
        return self

    def check_environment(self, env_name: str) -> None:
        """Reject an environment known to give no role attribution (no ce tokens)."""
        if env_name in ENVS_WITHOUT_ROLE_ATTRIBUTION:
            raise ValueError(
                f"echo on environment name = {env_name!r}: that environment gives no role "
                "attribution (its rollouts are single-turn: no observation tokens, no "
                "Rollout.token_roles), so echo's ce would train nothing; set name to an "
                "environment whose rollouts carry "
                "token_roles (feature_deletion, or your own multi-turn environment built on "
                "run_agent_rollouts), or set algorithm.advantage.type = 'grpo'"
            )


class _PairFields(_Advantage):
    pairs_path: str | None = Field(
        None,
        description="JSONL of DPOPair / NormalizedDPOPair records (null: the pairs shipped "
        "with the package).",
    )
    pairs_per_group: int = Field(1, ge=0, description="Pairs drawn from the pool per group.")


class ReplayDPOAdvantage(_PairFields):
    """Trace-replay DPO (Composer channel 3) on teacher-consensus preference pairs."""

    trains: ClassVar[tuple[str, ...]] = ("dpo",)

    renames: ClassVar[dict[str, str]] = {
        "loss": "dpo_variant",
        "weight": "beta_replay",
    }
    loss_fields: ClassVar[tuple[str, ...]] = ("replay_dpo_beta", "dpo_variant")

    type: Literal["replay_dpo"] = Field("replay_dpo", description="Algorithm name.")
    beta_replay: float = Field(1.0, gt=0, description="Weight of each pair in the dpo component.")
    replay_dpo_beta: float | None = Field(
        None, gt=0, description="Required loss.replay_dpo_beta (DPO beta); null: the run's (0.1)."
    )
    dpo_variant: Literal["dpo", "simpo"] | None = Field(
        None, description="Required loss.dpo_variant ('dpo' or 'simpo'); null: the run's ('dpo')."
    )


class ComposerAdvantage(_SelfDistillation, _PairFields):
    """The full recipe: Dr.GRPO + alpha_sdpo * SDPO jsd + beta_replay * trace-replay DPO."""

    trains: ClassVar[tuple[str, ...]] = ("rl", "jsd", "dpo")
    group_relative: ClassVar[bool] = True
    backends: ClassVar[frozenset[str]] = frozenset({"native", "trl"})

    renames: ClassVar[dict[str, str]] = {
        "alpha": "alpha_sdpo",
        "jsd_beta": "sdpo_jsd_beta",
        "dpo_beta": "replay_dpo_beta",
    }
    loss_fields: ClassVar[tuple[str, ...]] = ("sdpo_jsd_beta", "replay_dpo_beta")

    type: Literal["composer"] = Field("composer", description="Algorithm name.")
    alpha_sdpo: float = Field(
        0.1, ge=0, description="jsd weight on an error site's sampled tokens (the SDPO weight)."
    )
    beta_replay: float = Field(0.05, ge=0, description="Weight of each replayed DPO pair.")
    replay_dpo_beta: float | None = Field(
        None, gt=0, description="Required loss.replay_dpo_beta (DPO beta); null: the run's (0.1)."
    )


#: The built-in algorithms: ``type`` -> config class.
BUILTIN_ADVANTAGES: dict[str, type[_Advantage]] = {
    cls.model_fields["type"].default: cls
    for cls in (
        GRPOAdvantage,
        MaxRLAdvantage,
        RewardAdvantage,
        CustomAdvantage,
        OPDAdvantage,
        OPSDAdvantage,
        SDPOAdvantage,
        SFTAdvantage,
        EchoAdvantage,
        ReplayDPOAdvantage,
        ComposerAdvantage,
    )
}
#: Built-in types whose advantage is relative to the group (``group_relative``).
GROUP_RELATIVE = frozenset(n for n, c in BUILTIN_ADVANTAGES.items() if c.group_relative)
#: Built-in types that train ``rl`` and so need the sampler's log-probs of the policy.
RL_TYPES = frozenset(n for n, c in BUILTIN_ADVANTAGES.items() if c.needs_policy_logprobs())


class UserAdvantage(_Advantage):
    """The config of a user's algorithm: subclass it, declare what the algorithm trains
    (``trains``, and ``group_relative`` when its advantage is relative to the group) and add
    the algorithm's options as fields; name it as the ``config_class`` of the ``Algorithm``
    subclass. ``type`` is that class's import path, as the run config writes it::

        [envs.algorithm.advantage]
        type = "my_pkg.algos:LeaveOneOut"
        scale = 2.0

    A user's algorithm trains in the native loop only (``backends`` stays ``{"native"}``).
    """

    type: str = Field(
        pattern=IMPORT_PATH_PATTERN,
        description="'package.module:Class' of the Algorithm subclass.",
    )

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if cls.backends != {"native"}:
            raise TypeError(
                f"{cls.__name__}.backends = {sorted(cls.backends)}: a user's algorithm trains "
                "in the native loop only; leave backends out"
            )


def user_algorithm(path: str) -> Any:
    """The ``Algorithm`` subclass ``'package.module:Class'`` names (imported now).

    Raises:
        ValueError: one line naming ``path`` and the fix: not a built-in name nor an import
            path, a module that does not import, no such class, not an ``Algorithm``
            subclass, or no ``config_class`` of its own (a :class:`UserAdvantage` subclass
            declaring ``trains``).
    """
    fix = "set type to a built-in algorithm or to 'package.module:Class' of an Algorithm subclass"
    if not re.fullmatch(IMPORT_PATH_PATTERN, path):
        close = difflib.get_close_matches(path, list(BUILTIN_ADVANTAGES), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"type {path!r} is neither a built-in algorithm ({', '.join(BUILTIN_ADVANTAGES)}) "
            f"nor 'package.module:Class' of an Algorithm subclass{hint}; set one of those"
        )
    from composer_replication.common.callables import MissingName, import_named

    module_name, _, attr = path.partition(":")
    try:
        cls = import_named(path)
    except MissingName as exc:
        raise ValueError(f"type {path!r}: {exc}; {fix}") from None
    except Exception as exc:  # the user's module: name it, in one line
        raise ValueError(
            f"type {path!r}: module {module_name!r} does not import "
            f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}); "
            f"{fix}"
        ) from None
    # the class's own module imported the algorithm base if it subclasses it: read it from
    # there (the config layer imports no runtime code)
    base = sys.modules.get("composer_replication.algo.base")
    if base is None or not (isinstance(cls, type) and issubclass(cls, base.Algorithm)):
        raise ValueError(
            f"type {path!r} is not an Algorithm subclass "
            f"(composer_replication.algo.Algorithm); {fix}"
        )
    config_class = getattr(cls, "config_class", None)
    if not (isinstance(config_class, type) and issubclass(config_class, UserAdvantage)):
        shown = getattr(config_class, "__name__", repr(config_class))
        raise ValueError(
            f"type {path!r}: {attr}.config_class is {shown}; give {attr} a config_class "
            "of its own, a subclass of composer_replication.config.advantage.UserAdvantage "
            "declaring what it trains (e.g. trains = ('rl',))"
        )
    if not config_class.trains:
        raise ValueError(
            f"type {path!r}: {config_class.__name__} declares no trains; declare the loss "
            "components its samples carry weights for, e.g. trains = ('rl',)"
        )
    from composer_replication.config.components import component_names

    unknown = sorted(set(config_class.trains) - set(component_names()))
    if unknown:
        raise ValueError(
            f"type {path!r}: {config_class.__name__}.trains names unknown loss components "
            f"{unknown}; use some of {component_names()} (or register one: "
            "config.components.register_component)"
        )
    return cls


def _user_config(kind: str, value: Any) -> UserAdvantage:
    """``value`` (a raw table) validated by the config class of the user algorithm ``kind``;
    its first error becomes one line naming the field."""
    config_class = user_algorithm(kind).config_class
    try:
        return config_class.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg", "")).removeprefix("Value error, ")
        shown = "" if isinstance(first.get("input"), dict) else f" (got {first.get('input')!r})"
        raise ValueError(
            f"type {kind!r}: {where + ': ' if where else ''}{message}{shown}"
        ) from None


#: The union's tag of every user algorithm (a built-in one is tagged by its ``type``).
_USER_TAG = "package.module:Class"


def _advantage_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind is None:
        return None
    return kind if kind in BUILTIN_ADVANTAGES else _USER_TAG


def _resolve_user_type(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A table whose ``type`` is no built-in name is validated by the config class of the
    algorithm it names; a user config object must be that class's."""
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind not in BUILTIN_ADVANTAGES:
        value = _user_config(kind, value)
    elif isinstance(value, UserAdvantage):
        config_class = user_algorithm(value.type).config_class
        if not isinstance(value, config_class):
            raise ValueError(
                f"type {value.type!r} takes a {config_class.__name__} config, got "
                f"{type(value).__name__}; build it as {config_class.__name__}(...)"
            )
    return handler(value)


_MEMBERS = (
    *(Annotated[cls, Tag(name)] for name, cls in BUILTIN_ADVANTAGES.items()),
    Annotated[SerializeAsAny[UserAdvantage], Tag(_USER_TAG)],
)

AdvantageConfig = Annotated[
    Union[_MEMBERS],  # noqa: UP007 - a union built from the declarations
    Discriminator(
        _advantage_tag,
        custom_error_type="advantage_type_missing",
        custom_error_message="advantage.type is missing: name the algorithm (a built-in one, "
        "e.g. 'grpo', or 'package.module:Class')",
    ),
    WrapValidator(_resolve_user_type),
]
"""The per-algorithm config, selected by its ``type``: a built-in name, or the import path
of a user's ``Algorithm`` subclass (validated by its ``config_class``)."""
