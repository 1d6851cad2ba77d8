"""One definition per key: docs read from the schema, the generated YAML, `hybridflow config`, and the
source checks (every key is read somewhere, no worker keeps a default of its own)."""

import ast
import dataclasses
import re
from collections import defaultdict
from pathlib import Path

from hybridflow.commands.cli import main as cli
from hybridflow.config.checks import ignored_rule
from hybridflow.config.docs import (
    default_yaml,
    field_doc,
    render_yaml,
    shipped_configs,
    undocumented_keys,
)
from hybridflow.config.loader import hints, is_section, known_keys
from hybridflow.config.schema import DEFAULT_CONFIG_PATH, PPOConfig

PACKAGE = Path(__file__).resolve().parents[2] / "hybridflow"


def test_shipped_yamls_are_generated_from_the_schema():
    configs = shipped_configs()
    assert DEFAULT_CONFIG_PATH in configs and {p.name for p in configs} >= {
        "sft_trainer.yaml",
        "dpo_trainer.yaml",
    }
    for path, root in configs.items():
        assert path.read_text() == default_yaml(root), (
            f"hybridflow/config/yaml/{path.name} is stale: run `hybridflow config yaml --write`"
        )


def test_every_key_has_a_doc():
    for root in shipped_configs().values():
        assert undocumented_keys(root) == [], root.__name__
    assert field_doc(_Inner, "plain") == ""  # an undocumented field reads as no doc


@dataclasses.dataclass
class _Inner:
    """A section."""

    #: a long doc that
    #: spans two lines
    depth: int = 3
    plain: str = "x"


@dataclasses.dataclass
class _Outer(_Inner):
    mode: str = "a"  #: trailing doc
    inner: _Inner = dataclasses.field(default_factory=_Inner)  #: the nested one
    items: list[str] = dataclasses.field(  #: a multi-line field
        default_factory=lambda: ["p", "q"]
    )


def test_generator_handles_any_field():
    """Docs above (joined), trailing, on a multi-line field, inherited, on a section; none is fine too."""
    lines = render_yaml(dataclasses.asdict(_Outer()), _Outer)
    assert lines == [
        "depth: 3  # a long doc that spans two lines",
        "plain: x",
        "mode: a  # trailing doc",
        "",
        "inner:  # the nested one",
        "  depth: 3  # a long doc that spans two lines",
        "  plain: x",
        "items: [p, q]  # a multi-line field",
    ]


def test_config_keys_lists_every_key_with_type_default_and_doc(capsys):
    assert cli(["config", "keys"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "actor_rollout_ref.actor.optim.weight_decay: float = 0.01  # AdamW weight decay" in out
    assert (
        "trainer.logger: a list of one of 'console', 'file', 'tensorboard', 'wandb', 'mlflow' = [console, file]"
        in [line.split("  #")[0] for line in out]
    )
    leaves = [k for k in known_keys(PPOConfig) if not is_section(hints_of(k))]
    assert [line.split(":")[0] for line in out[: len(leaves)]] == leaves
    assert "trainer.balance_batch  # batches are not reordered by token count" in out[len(leaves) :]


def hints_of(key: str):
    cls = PPOConfig
    for part in key.split("."):
        tp = hints(cls)[part]
        cls = tp
    return tp


def test_config_show_prints_the_resolved_config_with_docs(capsys):
    assert cli(["config", "show", "algorithm.adv_estimator=grpo", "trainer.experiment_name=mine"]) == 0
    captured = capsys.readouterr()
    assert "  default_local_dir: runs/hybridflow/mine  # run folder (checkpoints, logs)" in captured.out
    assert (
        "  enable: false  # train a value model; null = only when algorithm.adv_estimator is gae"
        in captured.out
    )
    assert "data.train_files is required" in captured.err  # shown, but the config is still printed
    assert cli(["config", "show", "trainer.output_dir=x"]) == 2
    assert "did you mean 'trainer.default_local_dir'?" in capsys.readouterr().err


def _attribute_reads() -> set[tuple[str, str]]:
    """(base, attribute) of every attribute read in the package outside the config modules:
    ``self.config.ref.log_prob_micro_batch_size_per_gpu`` gives ("ref", "log_prob_micro_batch_size_per_gpu")."""
    reads = set()
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "config":  # the schema itself, its loader, docs, checks
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                base = node.value
                reads.add((base.id if isinstance(base, ast.Name) else getattr(base, "attr", ""), node.attr))
    return reads


def test_every_key_is_read_somewhere_or_accepted_with_a_warning():
    """A field name declared by one schema class must be read as an attribute somewhere; a name several
    classes declare (``log_prob_micro_batch_size_per_gpu`` in ref and rollout) must be read through its
    section's name (``ref.log_prob_micro_batch_size_per_gpu``), so one section's read does not cover the other."""
    fields = []

    def walk(cls, prefix, section):
        for name, tp in hints(cls).items():
            if is_section(tp):
                walk(tp, f"{prefix}{name}.", name)
            else:
                owner = next(k for k in cls.__mro__ if name in k.__dict__.get("__annotations__", {}))
                fields.append((prefix + name, section, owner, name))

    walk(PPOConfig, "", "")
    owners = defaultdict(set)
    for _, _, owner, name in fields:
        owners[name].add(owner)
    reads = _attribute_reads()
    read_names = {attr for _, attr in reads}
    unread = [
        key
        for key, section, _, name in fields
        if not ignored_rule(key)
        and not ((section, name) in reads if len(owners[name]) > 1 else name in read_names)
    ]
    assert unread == [], (
        "config keys nothing reads: read each one where it takes effect (a name that several schema classes "
        "declare as `<section>.<name>`, e.g. `critic = self.config; critic.grad_clip`), or, for a verl key "
        "that does nothing here, remove it from the schema and list it in config_checks.IGNORED_KEYS"
    )


_FALLBACK = re.compile(r"getattr\(\s*[\w.]*(cfg|config)[\w.]*\s*,[^,()]+,|\b_cfg\(|\b(cfg|config)\.get\(")


def test_the_package_reads_typed_fields_without_fallbacks():
    """Defaults live in the schema only: no getattr(config, key, default) or config.get(key, default), in any
    module but the config machinery (before: only workers/ and dataflow/ were checked)."""
    found = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] != "config"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _FALLBACK.search(line)
    ]
    assert found == []
    assert _FALLBACK.search('value = getattr(self.config, "weight_decay", 0.0)')  # the check does catch one
    assert _FALLBACK.search("micro = _cfg(optim_config, 'x', 1)")
