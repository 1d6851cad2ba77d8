"""The PPO trainer's configuration: verl's key names, validated into typed nested dataclasses.

Why dataclasses: the driver reads ``cfg.actor_rollout_ref.actor.optim.lr`` with real types, and every
mistake (an unknown key, a wrong type, batch sizes that do not divide) fails at load time with a message
that names the key, instead of deep inside a training step.

One source of truth for defaults: the dataclasses below. ``config/ppo_trainer.yaml`` documents every key
with a comment and holds the same values; a test fails if the two drift apart.

Three ways in, one mechanism (merge a nested dict over the defaults, check keys, then type it):
``load_config(overrides, config_path)`` for the command line, ``PPOConfig.from_dict`` for Python, and the
plain constructor ``PPOConfig(data=DataConfig(train_files=[...]))``. ``resolve()`` fills every derived
value in one place; ``validate()`` checks consistency.

Keys of verl's config that only mean something on GPUs or Megatron are accepted and dropped with an
``IgnoredKeyWarning`` (the table ``IGNORED_KEYS``), so verl command lines parse but nothing is silently
misread.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridflow.trainer import config_checks
from hybridflow.trainer.config_checks import (
    DTYPE_ALIASES,
    IGNORED_KEYS,
    ConfigError,
    IgnoredKey,
    IgnoredKeyWarning,
    check_batch_sizes,
    check_choices,
    check_cross_fields,
    check_ranges,
    get_key,
    ignored_rule,
    path_fields,
    warn_ignored,
)

__all__ = ["DEFAULT_CONFIG_PATH", "IGNORED_KEYS", "ConfigError", "IgnoredKey", "IgnoredKeyWarning", "PPOConfig",
           "load_config"]

DEFAULT_CONFIG_PATH = Path(__file__).parent / "config" / "ppo_trainer.yaml"


# ---------------------------------------------------------------------------------------------- schema
# Field comments live in config/ppo_trainer.yaml (the user-facing documentation of every key).

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
Dtype = Literal["auto", "fp32", "bf16", "fp16", "float32", "bfloat16", "float16"]


@dataclass
class SFTConfig:
    """An optional supervised loss mixed into the policy update (hybridflow extension)."""
    files: list[str] | None = None
    every_n_steps: int = 1
    batch_size: int = 8
    loss_coef: float = 0.1
    prompt_key: str = "prompt"
    response_key: str = "response"


@dataclass
class DataConfig:
    """Prompt files and batch sizes; ``train_batch_size`` counts prompts, before ``rollout.n``."""
    train_files: list[str] | None = None
    val_files: list[str] | None = None
    prompt_key: str = "prompt"
    train_batch_size: int = 8
    val_batch_size: int | None = None
    max_prompt_length: int = 512
    max_response_length: int = 64
    truncation: Literal["error", "left", "right"] = "error"
    filter_overlong_prompts: bool = True
    shuffle: bool = True
    seed: int | None = None
    sft: SFTConfig = field(default_factory=SFTConfig)


@dataclass
class ModelConfig:
    """A Hugging Face model folder or hub id; ``path: null`` (critic only) means the actor's model."""
    path: str | None = "default"
    trust_remote_code: bool = False
    enable_gradient_checkpointing: bool = False
    dtype: Dtype = "auto"
    use_remove_padding: bool = False
    #: compute each prompt once for the n responses sampled from it (log-probs, values and updates); an
    #: exact rewrite (same log-probs and gradients); false = score every row on its own
    share_prompt_prefix: bool = True


@dataclass
class OptimConfig:
    """AdamW with an optional warmup and cosine decay; shared by actor and critic."""
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    warmup_style: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    total_training_steps: int = -1


@dataclass
class PolicyLossConfig:
    """Which registered policy loss (``hybridflow.algorithms.get_policy_loss_fn``) the actor uses."""
    loss_mode: str = "vanilla"


@dataclass
class CheckpointContentsConfig:
    """What a checkpoint holds."""
    save_contents: list[Literal["model", "optimizer", "extra", "hf_model"]] = field(
        default_factory=lambda: ["model", "optimizer", "extra"]
    )


@dataclass
class ActorConfig:
    """The policy update: PPO mini-batches (in prompts) split into micro-batches (in sequences)."""
    strategy: Literal["auto", "fsdp2", "ddp", "single"] = "auto"
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = False  #: micro-batches filled to ppo_max_token_len_per_gpu tokens, not a row count
    ppo_max_token_len_per_gpu: int = 16384  #: real tokens per micro-batch when use_dynamic_bsz
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: LossAggMode = "token-mean"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLEstimator = "low_var_kl"
    grad_clip: float = 1.0
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointContentsConfig = field(default_factory=CheckpointContentsConfig)


@dataclass
class RefConfig:
    """The frozen reference policy (used when a KL loss or KL reward penalty is on)."""
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool = False  #: reference log-prob micro-batches filled to a token budget
    log_prob_max_token_len_per_gpu: int = 16384  #: real tokens per reference log-prob micro-batch


@dataclass
class SamplingConfig:
    """Sampling parameters; ``do_sample: false`` means greedy whatever the temperature."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True


@dataclass
class RolloutConfig(SamplingConfig):
    """Generation: the engine, sampling for training, and ``val_kwargs`` for validation."""
    name: Literal["hf", "vllm"] = "hf"
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool = False  #: old-log-prob micro-batches filled to a token budget
    log_prob_max_token_len_per_gpu: int = 16384  #: real tokens per old-log-prob micro-batch
    micro_batch_size: int | None = None
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 1
    val_kwargs: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0, do_sample=False))


@dataclass
class ActorRolloutRefConfig:
    """The policy model in its three roles: trained actor, generating rollout, frozen reference."""
    hybrid_engine: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticConfig:
    """The value model; ``null`` sizes and epochs follow the actor's, ``enable: null`` follows GAE."""
    enable: bool | None = None
    model: ModelConfig = field(default_factory=lambda: ModelConfig(path=None))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = False  #: value and update micro-batches filled to ppo_max_token_len_per_gpu tokens
    ppo_max_token_len_per_gpu: int = 32768  #: real tokens per critic micro-batch when use_dynamic_bsz
    ppo_epochs: int | None = None
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = "token-mean"
    grad_clip: float = 1.0


@dataclass
class RewardModelPathConfig:
    """Where a learned reward model lives and which tokenizer its inputs are re-templated with."""
    path: str | None = None
    input_tokenizer: str | None = None


@dataclass
class TwoStageRewardConfig:
    """Score everything with the cheap reward, then only the top share with the reward model."""
    enable: bool = False
    top_k_ratio: float = 0.3
    threshold: float | None = None
    unselected: Literal["keep", "scale", "zero"] = "keep"
    unselected_scale: float = 1.0


@dataclass
class RewardModelConfig:
    """A learned reward model (off by default: rule-based rewards come from the reward manager)."""
    enable: bool = False
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    micro_batch_size_per_gpu: int = 8
    reward_manager: str = "naive"
    dummy: bool = False
    launch_reward_fn_async: bool = False
    two_stage: TwoStageRewardConfig = field(default_factory=TwoStageRewardConfig)


@dataclass
class CustomRewardFunctionConfig:
    """A user reward function ``name`` in the Python file ``path``."""
    path: str | None = None
    name: str = "compute_score"


@dataclass
class KLControlConfig:
    """The KL coefficient of the in-reward penalty: fixed, or adapted towards ``target_kl``."""
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class AlgorithmConfig:
    """Advantage estimation and the KL penalty in the reward."""
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"  # verl's default, so its command lines mean the same here
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLEstimator = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)


@dataclass
class ReplayScheduleEntry:
    """Until ``until_step`` (exclusive), sample with ``strategy`` (and ``alpha``, if given)."""
    until_step: int
    strategy: str
    alpha: float | None = None


@dataclass
class ReplayBufferConfig:
    """Past rollouts replayed in the actor update (hybridflow extension; ``hybridflow.trainer.replay``)."""
    enable: bool = False
    capacity: int = 1024
    sample_size: int = 0
    strategy: str = "uniform"
    alpha: float = 0.6
    beta: float = 0.4
    schedule: list[ReplayScheduleEntry] | None = None


@dataclass
class TrainerConfig:
    """The run: length, logging, workers, validation and checkpoint cadence, resuming."""
    total_epochs: int = 1
    total_training_steps: int | None = None
    project_name: str = "hybridflow"
    experiment_name: str = "run"
    logger: list[Literal["console", "file", "tensorboard", "wandb", "mlflow"]] = field(
        default_factory=lambda: ["console", "file"]
    )
    log_val_generations: int = 0
    nnodes: int = 1
    n_gpus_per_node: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["local", "ray"] = "local"
    n_workers: int = 1
    ray_kwargs: dict[str, Any] = field(default_factory=dict)
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None
    max_ckpt_to_keep: int | None = None
    seed: int = 42
    balance_batch: bool = False
    critic_warmup: int = 0


@dataclass
class PPOConfig:
    """The whole configuration; every section has defaults, so ``PPOConfig()`` is complete."""
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    replay_buffer: ReplayBufferConfig = field(default_factory=ReplayBufferConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @classmethod
    def from_dict(cls, tree: dict[str, Any]) -> PPOConfig:
        """A (partial) nested dict merged over the defaults, interpolations resolved, then typed.

        Not resolved (see ``resolve``) and not validated, so ``from_dict(cfg.to_dict())`` round-trips.
        """
        merged = PPOConfig().to_dict()
        _merge(merged, tree, [], "from_dict")
        return _build_config(merged)

    @classmethod
    def from_overrides(cls, overrides: list[str]) -> PPOConfig:
        """Same as ``load_config(overrides)``: packaged defaults + ``a.b=c`` overrides, resolved, validated."""
        return load_config(overrides)

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (deep copy), e.g. to save as ``config.yaml`` in the run folder."""
        return dataclasses.asdict(self)

    def resolve(self) -> PPOConfig:
        """A copy with every derived value filled in; idempotent.

        Interpolations (``${trainer.project_name}``) are resolved, ``~`` expanded in paths, and:
        trainer.device auto -> cuda if available else cpu; model.dtype auto -> bf16 on cuda, fp32 on cpu
        (aliases like bfloat16 -> bf16); data.seed null -> trainer.seed; critic.enable null -> whether
        algorithm.adv_estimator is gae; critic.model.path, ppo_mini_batch_size, ppo_epochs null -> the actor's.
        """
        cfg = PPOConfig.from_dict(self.to_dict())
        arr, critic, trainer = cfg.actor_rollout_ref, cfg.critic, cfg.trainer
        if trainer.device == "auto":
            trainer.device = "cuda" if config_checks.cuda_available() else "cpu"
        for model in (arr.model, critic.model):
            model.dtype = DTYPE_ALIASES.get(model.dtype, model.dtype)
            if model.dtype == "auto":
                model.dtype = "bf16" if trainer.device == "cuda" else "fp32"
        if cfg.data.seed is None:
            cfg.data.seed = trainer.seed
        if critic.enable is None:
            critic.enable = cfg.algorithm.adv_estimator == "gae"
        if critic.model.path is None:
            critic.model.path = arr.model.path
        if critic.ppo_mini_batch_size is None:
            critic.ppo_mini_batch_size = arr.actor.ppo_mini_batch_size
        if critic.ppo_epochs is None:
            critic.ppo_epochs = arr.actor.ppo_epochs
        for owner, name in path_fields(cfg):
            value = getattr(owner, name)
            if isinstance(value, str):
                setattr(owner, name, os.path.expanduser(value))
            elif isinstance(value, list):
                setattr(owner, name, [os.path.expanduser(v) for v in value])
        return cfg

    def validate(self) -> None:
        """Check the resolved config for consistency; a ConfigError explains the first problem.

        Also warns (IgnoredKeyWarning) for GPU-only keys set away from their default.
        """
        cfg = self.resolve()
        check_ranges(cfg)
        check_batch_sizes(cfg)
        check_choices(cfg)
        check_cross_fields(cfg)
        _warn_ignored_schema_keys(cfg)


def load_config(overrides: list[str] | None = None, config_path: str | os.PathLike | None = None) -> PPOConfig:
    """The packaged defaults, a user YAML merged over them, then Hydra-style overrides; resolved, validated.

    Overrides: ``a.b=value`` (value parsed as YAML: ``1e-6``, ``true``, ``null``, ``[a,b]``; a bare value
    for a list key is a one-element list), ``+a.b=value`` adds a key inside a free-form dict such as
    ``trainer.ray_kwargs`` (the rest of the schema is closed), ``++a.b=value`` sets or adds, ``~a.b``
    deletes a key of a free-form dict. Values may interpolate others: ``${actor_rollout_ref.model.path}``.
    """
    tree = _load_yaml(DEFAULT_CONFIG_PATH)
    if config_path is not None:
        _merge(tree, _load_yaml(config_path), [], f"config file {os.fspath(config_path)}")
    for text in overrides or []:
        _apply_override(tree, text)
    cfg = _build_config(tree).resolve()
    cfg.validate()
    return cfg


def _load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {os.fspath(path)} must hold a mapping of sections, got {type(tree).__name__}")
    return tree


def _warn_ignored_schema_keys(cfg: PPOConfig) -> None:
    """Warn for schema keys in IGNORED_KEYS set away from their default (a default changes nothing)."""
    defaults, vllm = PPOConfig(), cfg.actor_rollout_ref.rollout.name == "vllm"
    for key in _known_keys():
        rule = ignored_rule(key)
        if rule and not (rule.used_with_vllm and vllm) and get_key(cfg, key) != get_key(defaults, key):
            warn_ignored(key, rule, get_key(cfg, key))


# ------------------------------------------------------------------------------- merging and overrides


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _schema_entry(path: list[str]) -> tuple[Any, bool] | None:
    """(type, inside_free_form_dict) of the key at ``path``; None for a key the schema does not have."""
    tp: Any = PPOConfig
    for seg in path:
        if get_origin(tp) is dict:
            return Any, True
        if not _is_section(tp) or seg not in _hints(tp):
            return None
        tp = _hints(tp)[seg]
    return tp, False


@cache
def _known_keys() -> tuple[str, ...]:
    """Every dotted key of the schema, sections included."""
    keys: list[str] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        for name, value in node.items():
            keys.append(prefix + name)
            if isinstance(value, dict):
                walk(value, f"{prefix}{name}.")

    walk(PPOConfig().to_dict(), "")
    return tuple(keys)


def _initials(name: str) -> str:
    words = name.split("_")
    return "".join(w[0] for w in words if w) if len(words) > 1 else ""


def _nearest_key(key: str, known: list[str] | tuple[str, ...]) -> str | None:
    """The known key the user most likely meant, or None.

    In order: a sibling that abbreviates the leaf or is abbreviated by it (lr ~ learning_rate) or extends
    it (ppo_micro_batch_size -> ppo_micro_batch_size_per_gpu); a sibling whose leaf name is close; the same
    leaf name in another section; the closest full dotted path.
    """
    section, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == section}
    for name, full in siblings.items():
        if leaf == _initials(name) or name == _initials(leaf) or name.startswith(f"{leaf}_"):
            return full
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)
    if close:
        return siblings[close[0]]
    same_leaf = [k for k in known if k.rpartition(".")[2] == leaf]
    close = difflib.get_close_matches(key, same_leaf or list(known), n=1, cutoff=0.0 if same_leaf else 0.6)
    return close[0] if close else None


def _unknown_key_error(key: str, known: list[str] | tuple[str, ...], source: str) -> ConfigError:
    near = _nearest_key(key, known)
    where = f" in {source}" if source else ""
    hint = f"; did you mean '{near}'?" if near else ""
    return ConfigError(f"unknown config key '{key}'{where}{hint}")


def _merge(tree: dict[str, Any], updates: Any, prefix: list[str], source: str) -> None:
    """Merge the nested dict ``updates`` into ``tree`` in place, checking every key against the schema."""
    if not isinstance(updates, dict):
        raise ConfigError(f"{'.'.join(prefix) or 'the config'} in {source} must be a mapping, got {updates!r}")
    for name, value in updates.items():
        path = [*prefix, str(name)]
        key = ".".join(path)
        if _schema_entry(path) is None:
            rule = ignored_rule(key)
            for leaf, leaf_value in _leaves(key, value):
                if rule is None:
                    raise _unknown_key_error(leaf, _known_keys(), source)
                warn_ignored(leaf, rule, leaf_value)
        elif isinstance(value, dict) and isinstance(tree.get(name), dict):
            _merge(tree[name], value, path, source)
        else:
            tree[name] = copy.deepcopy(value)


def _leaves(key: str, value: Any) -> list[tuple[str, Any]]:
    """The dotted leaf keys under ``key`` (so messages name ``a.b.c``, not the section ``a``)."""
    if not isinstance(value, dict) or not value:
        return [(key, value)]
    return [leaf for name, v in value.items() for leaf in _leaves(f"{key}.{name}", v)]


class _ValueLoader(yaml.SafeLoader):
    """YAML 1.1 SafeLoader that also reads ``1e-6`` (no dot) as a float, as YAML 1.2 and OmegaConf do."""


_ValueLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"), list("-+0123456789.")
)

_OVERRIDE = re.compile(r"(?P<op>\+\+|\+|~)?(?P<key>[A-Za-z_][\w-]*(?:\.[\w-]+)*)(?:=(?P<value>.*))?", re.DOTALL)


def _parse_override(text: str) -> tuple[str, str, Any]:
    """``"+a.b=[1,2]"`` -> ``("+", "a.b", [1, 2])``."""
    match = _OVERRIDE.fullmatch(text)
    if match is None or (match["op"] != "~" and match["value"] is None):
        raise ConfigError(f"cannot parse override {text!r}: expected key=value, +key=value, ++key=value or ~key")
    try:
        value = None if match["value"] is None else yaml.load(match["value"], Loader=_ValueLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"cannot parse the value of override {text!r} as YAML: {err}") from None
    return match["op"] or "", match["key"], value


def _apply_override(tree: dict[str, Any], text: str) -> None:
    op, key, value = _parse_override(text)
    path, source = key.split("."), f"override {text!r}"
    entry = _schema_entry(path)
    if entry is not None:
        parent = _lookup(tree, path[:-1])
        exists = isinstance(parent, dict) and path[-1] in parent
        free_form = entry[1]
        if op == "~":
            if not free_form:
                raise ConfigError(f"{source}: {key} is part of the config schema and cannot be deleted; "
                                  "set it to a value instead")
            if not exists:
                raise ConfigError(f"{source}: cannot delete {key}: it is not set")
            del parent[path[-1]]
            return
        if op == "+" and exists:
            raise ConfigError(f"{source}: {key} already exists; drop the '+' to change it")
        if op == "" and not exists:
            raise ConfigError(f"{source}: {key} is not set; add it with +{key}=...")
    nested: Any = value
    for name in reversed(path):
        nested = {name: nested}
    _merge(tree, nested, [], source)


def _lookup(tree: Any, path: list[str]) -> Any:
    for name in path:
        if not isinstance(tree, dict) or name not in tree:
            return None
        tree = tree[name]
    return tree


# ------------------------------------------------------------------------------------------- typing


def _build_config(tree: dict[str, Any]) -> PPOConfig:
    """Resolve ``${...}`` interpolations, then type the nested dict into PPOConfig."""
    if "${" in repr(tree):  # OmegaConf is slow (~0.1 s); a resolved tree skips it
        try:
            tree = OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
        except OmegaConfBaseException as err:
            raise ConfigError(f"cannot resolve an interpolation in the config: {err}") from None
    return _build(PPOConfig, tree, "")


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(args[0])}"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is dict or _is_section(tp):
        return "a mapping"
    return tp.__name__


def _type_error(key: str, tp: Any, value: Any) -> ConfigError:
    got = "null" if value is None else f"{value!r} ({type(value).__name__})"
    return ConfigError(f"{key} must be {_type_name(tp)}, got {got}")


def _build(tp: Any, value: Any, key: str) -> Any:
    """``value`` checked against (and converted to) the annotation ``tp``; ``key`` names it in errors."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = (a for a in args if a is not type(None))
        return _build(inner, value, key)
    if _is_section(tp) and isinstance(value, dict):
        return _build_section(tp, value, key)
    if origin is list and value is not None:
        items = value if isinstance(value, list) else [value]  # trainer.logger=console -> [console]
        return [_build(args[0], item, f"{key}[{i}]") for i, item in enumerate(items)]
    if origin is dict and isinstance(value, dict):
        return value
    if origin is Literal and isinstance(value, str) and value in args:
        return value
    accepted = _SCALARS.get(tp, ())
    if isinstance(value, accepted) and (tp is bool or not isinstance(value, bool)):
        return tp(value)
    raise _type_error(key, tp, value)


# Scalar annotation -> the parsed value types it accepts (bools only for bool, although bool is an int).
# A str field takes numbers too: YAML reads experiment_name=2024 as an int.
_SCALARS: dict[type, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float), str: (str, int, float)}


def _build_section(cls: type, values: dict[str, Any], key: str) -> Any:
    hints = _hints(cls)
    names = {name: f"{key}.{name}" if key else name for name in hints}
    for name in values:
        if name not in hints:
            raise _unknown_key_error(f"{key}.{name}" if key else name, list(names.values()), "")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in values]
    if missing:
        raise ConfigError(f"{names[missing[0]]} is required")
    return cls(**{name: _build(hints[name], value, names[name]) for name, value in values.items()})
