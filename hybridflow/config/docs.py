"""Each config key's doc, read from the schema's ``#:`` comments, and what is rendered from it.

The docs are the ``#:`` comments in the schema modules (``schema.py``, ``sections.py``, ``reward_sections.py``,
``algorithm_sections.py``, ``actor_sections.py``, ``offline.py``): ``name: type = default  #: doc`` or, for a
long doc, ``#: ...`` lines directly above the field. They are read from the source (``ast`` for the fields,
``tokenize`` for the comments), so a field is documented where it is defined and nowhere else. From the
schema and these docs come the shipped ``config/yaml/ppo_trainer.yaml``, ``hybridflow config keys`` (every key
with type, default and doc) and ``hybridflow config show`` (a resolved config as commented YAML).

``hybridflow config yaml --write`` (or ``python -m hybridflow.config.docs yaml --write``) regenerates
the shipped YAML after a field changes; a test fails while it is stale.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import sys
import textwrap
import tokenize
import warnings
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from hybridflow.config.checks import IGNORED_KEYS, ConfigError
from hybridflow.config.loader import Schema, hints, is_section, type_name
from hybridflow.config.schema import DEFAULT_CONFIG_PATH, PPOConfig, load_unvalidated

YAML_HEADER = """\
# hybridflow {what} configuration: verl's key names, one comment per key.
# Generated from the dataclasses in hybridflow/config/{module}.py (`hybridflow config yaml --write`):
# edit the `#:` docs and defaults there, not this file.
# Override on the command line: key=value, +key=value (add inside free-form dicts), ~key (delete there).
"""


def shipped_configs() -> dict[Path, type[Schema]]:
    """Every shipped YAML and the root dataclass it is generated from: PPO's and the offline trainers'."""
    from hybridflow.config.offline import CONFIGS, default_config_path

    return {DEFAULT_CONFIG_PATH: PPOConfig, **{default_config_path(c): c for c in CONFIGS.values()}}


@cache
def _module_docs(path: str) -> dict[tuple[str, str], str]:
    """``(class name, field name) -> doc`` for every annotated field of every class in the file."""
    source = Path(path).read_text()
    comments = {
        tok.start[0]: tok.string
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and tok.string.startswith("#:")
    }
    lines = source.splitlines()
    docs: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            end = stmt.end_lineno or stmt.lineno
            trailing = [comments[n] for n in range(stmt.lineno, end + 1) if n in comments]
            above: list[str] = []
            line = stmt.lineno - 1
            while line in comments and lines[line - 1].strip().startswith("#:"):
                above.insert(0, comments[line])
                line -= 1
            parts = [c[2:].strip() for c in above + trailing[:1]]
            if parts:
                docs[(node.name, stmt.target.id)] = " ".join(parts)
    return docs


def field_doc(cls: type, name: str) -> str:
    """The ``#:`` doc of field ``name`` of the schema class ``cls`` (or of the base class defining it)."""
    for klass in cls.__mro__:
        try:
            docs = _module_docs(inspect.getsourcefile(klass) or "")
        except (TypeError, OSError):
            continue
        if (klass.__name__, name) in docs:
            return docs[(klass.__name__, name)]
    return ""


def undocumented_keys(root: type = PPOConfig) -> list[str]:
    """Keys of the schema ``root`` without a ``#:`` doc (a test keeps this empty)."""
    missing: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in hints(cls).items():
            if not field_doc(cls, name):
                missing.append(prefix + name)
            if is_section(tp):
                walk(tp, f"{prefix}{name}.")

    walk(root, "")
    return missing


def _yaml_doc(cls: type, name: str, tp: Any) -> str:
    """The doc, with the allowed values appended for a ``Literal`` field whose doc does not list them."""
    doc = field_doc(cls, name)
    choices = get_args(tp) if get_origin(tp) is Literal else ()
    if choices and " | " not in doc:
        doc = f"{doc}: {' | '.join(map(str, choices))}" if doc else " | ".join(map(str, choices))
    return doc


def _flow(value: Any) -> str:
    """One value as one line of YAML: ``null``, ``1.0e-06``, ``[console, file]``, ``{}``."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20, sort_keys=False).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def render_yaml(tree: dict[str, Any], cls: type = PPOConfig, indent: int = 0) -> list[str]:
    """The lines of ``tree`` (a ``to_dict()`` of ``cls``) as block YAML, each key with its doc."""
    out: list[str] = []
    pad = " " * indent
    for name, tp in hints(cls).items():
        doc = _yaml_doc(cls, name, tp)
        value = tree[name]
        if indent == 0 and out and is_section(tp):  # a blank line before each top-level section
            out.append("")
        section = is_section(tp) and isinstance(value, dict)
        line = f"{pad}{name}:" + ("" if section else f" {_flow(value)}")
        if doc and len(line) + len(doc) + 4 > _WIDTH:  # a long doc goes above its key, wrapped
            out.extend(
                textwrap.wrap(
                    doc,
                    _WIDTH,
                    initial_indent=f"{pad}# ",
                    subsequent_indent=f"{pad}# ",
                    break_on_hyphens=False,
                )
            )
            out.append(line)
        else:
            out.append(line + (f"  # {doc}" if doc else ""))
        if section:
            out.extend(render_yaml(value, tp, indent + 2))
    return out


_WIDTH = 110


def default_yaml(root: type[Schema] = PPOConfig) -> str:
    """The text of the shipped YAML of ``root`` (``ppo_trainer.yaml`` for PPOConfig): defaults and docs."""
    what = "PPO/GRPO trainer" if root is PPOConfig else f"{root.kind.upper()} trainer"
    header = YAML_HEADER.format(what=what, module=root.__module__.rpartition(".")[2])
    return header + "\n" + "\n".join(render_yaml(root().to_dict(), root)) + "\n"


def key_table() -> list[str]:
    """``key: type = default  # doc`` for every leaf key of the schema, in schema order."""
    rows: list[str] = []

    def walk(cls: type, tree: dict[str, Any], prefix: str) -> None:
        for name, tp in hints(cls).items():
            if is_section(tp) and isinstance(tree[name], dict):
                walk(tp, tree[name], f"{prefix}{name}.")
            else:
                doc = field_doc(cls, name)
                rows.append(
                    f"{prefix}{name}: {type_name(tp)} = {_flow(tree[name])}" + (f"  # {doc}" if doc else "")
                )

    walk(PPOConfig, PPOConfig().to_dict(), "")
    return rows


def main(argv: list[str] | None = None) -> int:
    """``hybridflow config show [--config FILE] [overrides]``, ``config keys``, ``config yaml [--write]``."""
    parser = argparse.ArgumentParser(
        prog="hybridflow config", description="Inspect the trainer configuration."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print the resolved config as YAML, each key with its doc")
    show.add_argument("--config", help="a YAML file merged over the defaults")
    show.add_argument("overrides", nargs="*", help="key=value overrides, as for hybridflow train")
    sub.add_parser("keys", help="list every key with its type, default and doc")
    gen = sub.add_parser(
        "yaml",
        help="print (or --write) the shipped ppo_trainer.yaml (with --write also the "
        "sft/dpo/kto/rm ones), generated from the schema",
    )
    gen.add_argument("--write", action="store_true", help=f"write them to {DEFAULT_CONFIG_PATH.parent}")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "keys":
        print("\n".join(key_table()))
        print(
            "\n# accepted with a warning (verl keys that do nothing here; a glob covers every key below it):"
        )
        print("\n".join(f"{rule.pattern}  # {rule.why}" for rule in IGNORED_KEYS))
    elif args.command == "yaml":
        if args.write:
            for path, root in shipped_configs().items():
                path.write_text(default_yaml(root))
                print(f"wrote {path}")
        else:
            print(default_yaml(), end="")
    else:
        return _show(args.overrides, args.config)
    return 0


def _show(overrides: list[str], config_path: str | None) -> int:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_unvalidated(overrides, config_path)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print("\n".join(render_yaml(cfg.to_dict())))
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    try:
        cfg.validate()
    except ConfigError as err:  # still worth seeing: the user is usually fixing exactly this
        print(f"note: a run with this config would stop: {err}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
