"""No default competes with the schema's: a function parameter (or a ``getattr``/``.get`` fallback) named like
a config key has that key's schema default, or none. Before, ``ActorRolloutRefWorker`` seeded with 0 where
``trainer.seed`` is 42, and the actor weighted the SFT loss 1.0 where ``data.sft.loss_coef`` is 0.1."""

import ast
import dataclasses
from collections import defaultdict
from pathlib import Path

from hybridflow.config.loader import hints, is_section
from hybridflow.config.offline import CONFIGS
from hybridflow.config.schema import PPOConfig

PACKAGE = Path(__file__).resolve().parents[2] / "hybridflow"

# (module, function, parameter) whose name matches a config key but which is not that key, and why
NOT_CONFIG_VALUES = {
    ("single_controller/ray/resource_pool.py", "__init__", "name"): "a pool's name, not rollout.name",
    ("workers/sharding.py", "full_weights", "device"): "where gathered weights go, not trainer.device",
    ("runs/trained_model.py", "chat", "temperature"): "greedy chat with a trained model, no rollout",
    (
        "data/offline_tasks.py",
        "model_wrong_replies",
        "temperature",
    ): "prepare-data's sampling of wrong replies",
    ("data/offline_tasks.py", "model_wrong_replies", "batch_size"): "prepare-data's generation batch",
    ("data/offline_tasks.py", "model_wrong_replies", "seed"): "prepare-data's --seed",
    ("models/tiny.py", "make_tiny_model", "seed"): "the tiny test model's init seed",
    ("models/tiny.py", "make_tiny_vlm", "seed"): "the tiny vision-language model's init seed",
    ("models/tiny.py", "teach_conversations", "seed"): "the tiny test model's teaching seed",
    ("models/tiny.py", "teach_conversations", "lr"): "the tiny test model's teaching rate",
    (
        "rewards/gsm8k.py",
        "compute_score",
        "score",
    ): "verl's gsm8k signature: the full-marks value, not reward_model.code.score",
    # GSPO's own settings (the paper's) for direct calls; the actor always passes the config's
    ("algorithms/losses.py", "compute_policy_loss_gspo", "loss_agg_mode"): "GSPO's sequence-level mean",
}


def schema_defaults() -> dict[str, list]:
    """Config leaf name -> the defaults the schemas (PPO, SFT, DPO, KTO) give it."""
    found = defaultdict(list)

    def walk(cls: type) -> None:
        for f in dataclasses.fields(cls):
            if is_section(hints(cls)[f.name]):
                walk(hints(cls)[f.name])
            else:
                found[f.name].append(
                    f.default if f.default is not dataclasses.MISSING else f.default_factory()
                )

    for root in (PPOConfig, *CONFIGS.values()):
        walk(root)
    return dict(found)


def _value(node: ast.expr):
    value = ast.literal_eval(node)
    return list(value) if isinstance(value, tuple) else value


def shadowed_defaults(source: str, module: str, defaults: dict[str, list]) -> list[str]:
    """``module:line function(param=value)`` for each default that differs from the schema's for that name
    (None, "not given", is never a competing value), and each ``getattr(x, "key", d)`` / ``x.get("key", d)``
    that falls back to a value other than the schema's."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        pairs = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args.posonlyargs + node.args.args
            pairs = list(zip(args[len(args) - len(node.args.defaults) :], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            pairs = [(node.name, a.arg, d) for a, d in pairs]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            args = node.args[1:] if name == "getattr" else node.args if name == "get" else []
            if len(args) == 2 and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
                pairs = [(name, args[0].value, args[1])]
        for function, key, default in pairs:
            if key not in defaults or (module, function, key) in NOT_CONFIG_VALUES:
                continue
            try:
                value = _value(default)
            except ValueError:  # not a literal: computed from the caller's values
                continue
            if value is not None and value not in defaults[key]:
                problems.append(
                    f"{module}:{node.lineno} {function}({key}={value!r}): the schema says {defaults[key]}"
                )
    return problems


def test_no_signature_or_fallback_shadows_a_schema_default():
    defaults = schema_defaults()
    problems = [
        problem
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "config"  # the schema and its machinery
        for problem in shadowed_defaults(path.read_text(), str(path.relative_to(PACKAGE)), defaults)
    ]
    assert problems == [], (
        "take the value from the caller without a default, or make the default the schema's"
    )


def test_the_scan_catches_what_the_issue_found():
    """The two shadows of issue 20, as they were: the check can fail."""
    defaults = schema_defaults()
    seeded = "class W:\n    def __init__(self, config, seed: int = 0):\n        pass\n"
    assert shadowed_defaults(seeded, "workers/actor.py", defaults) == [
        "workers/actor.py:2 __init__(seed=0): the schema says [None, None, 42, 42, None, 42, None, 42, None, 42, None]"
    ]
    coef = "w = float(meta.get('loss_coef', 1.0))\n"
    assert shadowed_defaults(coef, "workers/actor.py", defaults) == [
        "workers/actor.py:1 get(loss_coef=1.0): the schema says [0.1]"
    ]
    assert shadowed_defaults("def f(seed: int = 42, lr=None): ...\n", "x.py", defaults) == []
