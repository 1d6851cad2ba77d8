"""Loading a config: YAML files, ``a.b=c`` overrides, typing a nested dict into a schema's dataclasses.

Generic: every function takes the root schema class (``PPOConfig``, ``SFTConfig``...) as an argument and
this module imports none of them. The schema says what exists; this module turns what a user wrote into
it, and when a key does not exist says what they meant: a name from TRL or OpenRLHF (``learning_rate``,
``output_dir``) gets the key it corresponds to (the schema's ``ALIASES``), a typo gets the nearest key,
and anything else gets no guess at all (a wrong guess costs more than none).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import warnings
from functools import cache
from typing import Any, ClassVar, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridflow.config.checks import ConfigError, DeprecatedKeyWarning, IgnoredKey, get_key, warn_ignored

__all__ = [
    "Schema",
    "apply_flat_keywords",
    "build_config",
    "known_keys",
    "load",
    "merge",
    "nearest_key",
    "schema_entry",
]

S = TypeVar("S", bound="Schema")


class Schema:
    """What a root config class (``PPOConfig``, ``SFTConfig``...) gives the loader: its other-library
    aliases, the keys it accepts with a warning, and the dict round trip. The loader imports no schema."""

    #: Names users bring from other libraries (TRL, OpenRLHF, ``TrainingArguments``) -> this schema's key.
    ALIASES: ClassVar[dict[str, str]] = {}
    #: the offline trainer a root config is for (sft, dpo, kto: its objective, YAML file and command); "" for PPO
    kind: ClassVar[str] = ""
    #: every root config is a dataclass (what ``dataclasses.asdict`` asks of it)
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    #: Keys that moved, old dotted key -> new one: the old one keeps working for one release, with a
    #: ``DeprecatedKeyWarning`` naming the new one.
    RENAMED: ClassVar[dict[str, str]] = {}

    @classmethod
    def ignored_rule(cls, key: str) -> IgnoredKey | None:
        """The rule under which an unknown ``key`` is accepted with a warning; None = an error."""
        return None

    @classmethod
    def from_dict(cls: type[S], tree: dict[str, Any]) -> S:
        """A (partial) nested dict merged over the defaults, interpolations resolved, then typed.

        Not resolved (see ``resolve``) and not validated, so ``from_dict(cfg.to_dict())`` round-trips.
        """
        merged = cls().to_dict()
        merge(merged, tree, [], "from_dict", cls)
        return build_config(merged, cls)

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (deep copy), e.g. to save as ``config.yaml`` in the run folder."""
        return dataclasses.asdict(self)

    def resolve(self: S) -> S:
        raise NotImplementedError


def load(
    root: type[S], overrides: list[str] | None = None, config_path: str | os.PathLike[str] | None = None
) -> S:
    """The schema ``root``'s defaults, a user YAML merged over them, then ``a.b=c`` overrides: typed and
    resolved (``root.resolve``), not yet checked for consistency (``validate``)."""
    tree = root().to_dict()
    if config_path is not None:
        merge(tree, load_yaml(config_path), [], f"config file {os.fspath(config_path)}", root)
    for text in overrides or []:
        apply_override(tree, text, root)
    return build_config(tree, root).resolve()


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    tree = OmegaConf.to_container(OmegaConf.load(os.fspath(path)), resolve=False)
    if not isinstance(tree, dict):
        raise ConfigError(
            f"config file {os.fspath(path)} must hold a mapping of sections, got {type(tree).__name__}"
        )
    return {str(key): value for key, value in tree.items()}


# ------------------------------------------------------------------------------------- the schema's keys


def hints(cls: type) -> dict[str, Any]:
    """The schema fields of the section ``cls`` and their types (class variables such as ``ALIASES`` are not keys)."""
    return _hints(cls)


# cached behind a function taking any class: mypy does not see a schema class (type[Schema]) as Hashable,
# since a dataclass instance is not, so the cached functions are called with a plain ``type``
@cache
def _hints(cls: type) -> dict[str, Any]:
    types_ = get_type_hints(cls)
    return {f.name: types_[f.name] for f in dataclasses.fields(cls)}


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def schema_entry(path: list[str], root: type) -> tuple[Any, bool] | None:
    """(type, inside_free_form_dict) of the key at ``path`` in the schema ``root`` (PPOConfig, or an offline
    trainer's config); None for a key the schema does not have."""
    tp: Any = root
    for seg in path:
        if get_origin(tp) is dict:
            return Any, True
        if not is_section(tp) or seg not in hints(tp):
            return None
        tp = hints(tp)[seg]
    return tp, False


def known_keys(root: type) -> tuple[str, ...]:
    """Every dotted key of the schema ``root``, sections included, in schema order."""
    return _known_keys(root)


@cache
def _known_keys(root: type) -> tuple[str, ...]:
    keys: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in hints(cls).items():
            keys.append(prefix + name)
            if is_section(tp):
                walk(tp, f"{prefix}{name}.")

    walk(root, "")
    return tuple(keys)


def _initials(name: str) -> str:
    words = name.split("_")
    return "".join(w[0] for w in words if w) if len(words) > 1 else ""


def nearest_key(key: str, known: list[str] | tuple[str, ...], aliases: dict[str, str]) -> str | None:
    """The known key the user most likely meant, or None when nothing is convincingly close.

    In order: a sibling that abbreviates the leaf or is abbreviated by it (lr ~ learning_rate) or extends
    it (ppo_micro_batch_size -> ..._per_gpu); a sibling whose leaf name is a near-typo; an alias from
    another library (the schema's ``ALIASES``); the same leaf name in another section (the closest such path).
    Leaves are compared alone: on whole dotted paths the shared section prefix makes unrelated leaves look
    alike (``trainer.output_dir`` and ``trainer.test_freq``).
    """
    section, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == section}
    for name, full in siblings.items():
        if leaf == _initials(name) or name == _initials(leaf) or name.startswith(f"{leaf}_"):
            return full
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.8)
    if close:
        return siblings[close[0]]
    if leaf in aliases and aliases[leaf] in known:
        return aliases[leaf]
    same_leaf = [k for k in known if k.rpartition(".")[2] == leaf]
    if not section and len(same_leaf) > 1:  # a bare `lr`: nothing says which section's was meant
        return None
    close = difflib.get_close_matches(key, same_leaf, n=1, cutoff=0.0)
    return close[0] if close else None


def unknown_key_error(
    key: str, root: type[Schema], source: str, known: list[str] | None = None
) -> ConfigError:
    """``key`` is not in the schema ``root`` (or among ``known``, the keys of one section): say what was meant."""
    known = known or list(known_keys(root))
    near = nearest_key(key, known, root.ALIASES)
    where = f" in {source}" if source else ""
    hint = f"; did you mean '{near}'?" if near else ""
    leaf = key.rpartition(".")[2]
    if near is not None and root.ALIASES.get(leaf) == near:
        hint += f" ('{leaf}' is another library's name for it)"
    same_leaf = [k for k in known if k.rpartition(".")[2] == leaf]
    if near is None and len(same_leaf) > 1:
        hint = f"; '{leaf}' is a key of several sections: {', '.join(same_leaf)}"
    return ConfigError(f"unknown config key '{key}'{where}{hint}")


# ------------------------------------------------------------------------------- merging and overrides


def merge(tree: dict[str, Any], updates: Any, prefix: list[str], source: str, root: type[Schema]) -> None:
    """Merge the nested dict ``updates`` into ``tree`` in place, checking every key against the schema
    ``root`` (keys the schema ignores are accepted with a warning: ``root.ignored_rule``; keys that moved go
    to their new place: ``root.RENAMED``)."""
    if not isinstance(updates, dict):
        raise ConfigError(
            f"{'.'.join(prefix) or 'the config'} in {source} must be a mapping, got {updates!r}"
        )
    if not prefix:
        updates = _moved_to_new_keys(updates, source, root)
    for name, value in updates.items():
        path = [*prefix, str(name)]
        key = ".".join(path)
        if schema_entry(path, root) is None:
            rule = root.ignored_rule(key)
            for leaf, leaf_value in _leaves(key, value):
                if rule is None:
                    raise unknown_key_error(leaf, root, source)
                warn_ignored(leaf, rule, leaf_value)
        elif isinstance(value, dict) and isinstance(tree.get(name), dict):
            merge(tree[name], value, path, source, root)
        else:
            tree[name] = copy.deepcopy(value)


def _moved_to_new_keys(updates: dict[str, Any], source: str, root: type[Schema]) -> dict[str, Any]:
    """``updates`` (a whole tree) with each key of ``root.RENAMED`` it holds moved to the new key, warning
    (``DeprecatedKeyWarning``) for each; ``updates`` itself is left as it was."""
    for old, new in root.RENAMED.items():
        *parents, leaf = old.split(".")
        holder = _lookup(updates, parents)
        if not isinstance(holder, dict) or leaf not in holder:
            continue
        updates = copy.deepcopy(updates)
        value = _lookup(updates, parents).pop(leaf)
        *sections, name = new.split(".")
        target = updates
        for section in sections:
            target = target.setdefault(section, {})
        target[name] = value
        warnings.warn(
            f"{old} (in {source}) is deprecated: it moved to {new}, which it sets; the old name works for "
            "one release",
            DeprecatedKeyWarning,
            stacklevel=4,
        )
    return updates


def _leaves(key: str, value: Any) -> list[tuple[str, Any]]:
    """The dotted leaf keys under ``key`` (so messages name ``a.b.c``, not the section ``a``)."""
    if not isinstance(value, dict) or not value:
        return [(key, value)]
    return [leaf for name, v in value.items() for leaf in _leaves(f"{key}.{name}", v)]


class _ValueLoader(yaml.SafeLoader):
    """YAML 1.1 SafeLoader that also reads ``1e-6`` (no dot) as a float, as YAML 1.2 and OmegaConf do."""


_ValueLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"),
    list("-+0123456789."),
)

_OVERRIDE = re.compile(
    r"(?P<op>\+\+|\+|~)?(?P<key>[A-Za-z_][\w-]*(?:\.[\w-]+)*)(?:=(?P<value>.*))?", re.DOTALL
)


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"+a.b=[1,2]"`` -> ``("+", "a.b", [1, 2])``."""
    match = _OVERRIDE.fullmatch(text)
    if match is None or (match["op"] != "~" and match["value"] is None):
        raise ConfigError(
            f"cannot parse override {text!r}: expected key=value, +key=value, ++key=value or ~key"
        )
    try:
        value = None if match["value"] is None else yaml.load(match["value"], Loader=_ValueLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"cannot parse the value of override {text!r} as YAML: {err}") from None
    return match["op"] or "", match["key"], value


def apply_override(tree: dict[str, Any], text: str, root: type[Schema]) -> None:
    op, key, value = parse_override(text)
    path, source = key.split("."), f"override {text!r}"
    entry = schema_entry(path, root)
    if entry is not None:
        parent = _lookup(tree, path[:-1])
        exists = isinstance(parent, dict) and path[-1] in parent
        free_form = entry[1]
        if op == "~":
            if not free_form:
                raise ConfigError(
                    f"{source}: {key} is part of the config schema and cannot be deleted; "
                    "set it to a value instead"
                )
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
    merge(tree, nested, [], source, root)


def _lookup(tree: Any, path: list[str]) -> Any:
    for name in path:
        if not isinstance(tree, dict) or name not in tree:
            return None
        tree = tree[name]
    return tree


# ------------------------------------------------------------------------------------------- typing


def build_config(tree: dict[str, Any], root: type[S]) -> S:
    """Resolve ``${...}`` interpolations, then type the nested dict into ``root``."""
    if "${" in repr(tree):  # OmegaConf is slow (~0.1 s); a resolved tree skips it
        try:
            resolved = OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
        except OmegaConfBaseException as err:
            raise ConfigError(f"cannot resolve an interpolation in the config: {err}") from None
        # the container of a DictConfig is a dict
        tree = {str(key): value for key, value in cast(dict[Any, Any], resolved).items()}
    return cast(S, build(root, tree, ""))  # build types the tree into root


def type_name(tp: Any) -> str:
    """How an annotation reads in messages and in ``config keys``: ``int or null``, ``a list of str``."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is list:
        return f"a list of {type_name(args[0])}"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is dict or is_section(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _type_error(key: str, tp: Any, value: Any) -> ConfigError:
    got = "null" if value is None else f"{value!r} ({type(value).__name__})"
    return ConfigError(f"{key} must be {type_name(tp)}, got {got}")


def build(tp: Any, value: Any, key: str) -> Any:
    """``value`` checked against (and converted to) the annotation ``tp``; ``key`` names it in errors."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = (a for a in args if a is not type(None))
        return build(inner, value, key)
    if is_section(tp) and isinstance(value, dict):
        return _build_section(tp, value, key)
    if is_section(tp) and isinstance(value, tp):
        return value
    if origin is list and value is not None:
        items = value if isinstance(value, list) else [value]  # trainer.logger=console -> [console]
        return [build(args[0], item, f"{key}[{i}]") for i, item in enumerate(items)]
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
_SCALARS: dict[type, tuple[type, ...]] = {
    bool: (bool,),
    int: (int,),
    float: (int, float),
    str: (str, int, float),
}


def _build_section(cls: type, values: dict[str, Any], key: str) -> Any:
    fields = hints(cls)
    names = {name: f"{key}.{name}" if key else name for name in fields}
    for name in values:
        if name not in fields:
            raise unknown_key_error(f"{key}.{name}" if key else name, Schema, "", list(names.values()))
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in values]
    if missing:
        raise ConfigError(f"{names[missing[0]]} is required")
    return cls(**{name: build(fields[name], value, names[name]) for name, value in values.items()})


# ------------------------------------------------------------------------- Config(flat=keywords)


def apply_flat_keywords(cfg: Schema, keywords: dict[str, Any]) -> None:
    """Set ``PPOConfig(...)`` keywords on ``cfg``: top-level sections, leaf names unique in the schema
    (``n=4``), or dotted keys (``**{"critic.optim.lr": 1e-5}``), each typed as an override would be."""
    root = type(cfg)
    for name, value in keywords.items():
        key = name if "." in name or name in hints(root) else _key_of_keyword(name, root)
        path = key.split(".")
        entry = schema_entry(path, root)
        if entry is None:
            raise unknown_key_error(key, root, f"{root.__name__}(...)")
        parent = get_key(cfg, ".".join(path[:-1])) if len(path) > 1 else cfg
        setattr(parent, path[-1], build(entry[0], copy.deepcopy(value), key))


def _key_of_keyword(name: str, root: type[Schema]) -> str:
    """The dotted key a bare keyword of ``root(...)`` means; a ConfigError when it is ambiguous or unknown."""
    cls, aliases = root.__name__, root.ALIASES
    if name in aliases:
        raise ConfigError(
            f"{cls} got {name}=: '{name}' is another library's name; hybridflow's key is "
            f"'{aliases[name]}': pass **{{'{aliases[name]}': ...}} or set it in its section"
        )
    matches = [k for k in known_keys(root) if k.rpartition(".")[2] == name]
    # rollout.n over rollout.val_kwargs.n: of two matches where one's section holds the other, the outer
    matches = [
        k
        for k in matches
        if not any(
            k.startswith(o.rpartition(".")[0] + ".") and k != o and o.count(".") < k.count(".")
            for o in matches
        )
    ]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        sections = " or ".join(k.rpartition(".")[0] for k in matches)
        raise ConfigError(
            f"{cls} got {name}=, which exists in {sections}: pass it inside its section, e.g. "
            f"{cls}.from_dict({_nested_example(matches[0])}) or **{{'{matches[0]}': ...}}"
        )
    leaves = sorted({k.rpartition(".")[2] for k in known_keys(root)})
    close = difflib.get_close_matches(name, leaves, n=1, cutoff=0.8)
    hint = f"; did you mean {close[0]}=?" if close else ""
    raise ConfigError(
        f"{cls} got an unknown keyword {name}={hint} (sections: "
        f"{', '.join(hints(root))}; `hybridflow config keys` lists every key)"
    )


def _nested_example(key: str) -> str:
    text = "..."
    for part in reversed(key.split(".")):
        text = f"{{'{part}': {text}}}"
    return text
