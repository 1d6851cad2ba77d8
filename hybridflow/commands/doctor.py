"""``hybridflow doctor [overrides]``: check a configuration in seconds, before hours are spent on it.

Runs fail most often before they start: batch sizes that do not divide, a data file that is not there,
prompts longer than ``max_prompt_length``, a reward function that raises on the first sample, a model
that will not fit. Each check below loads only what it needs (the tokenizer and the model's config, never
the weights; a few hundred dataset rows), prints one line with a verdict and the fix, and the command
exits 0 when nothing failed, 1 otherwise (``--json`` for machines).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import warnings
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hybridflow.commands.diagnosis import Check, Context
from hybridflow.commands.doctor_data import check_batches, check_dataset
from hybridflow.commands.doctor_support import check_support
from hybridflow.commands.memory_estimate import GB, estimate_memory, knob, model_shape
from hybridflow.commands.reward_probes import probes
from hybridflow.config.checks import (
    IgnoredKeyWarning,
    check_choices,
    check_cross_fields,
    check_ranges,
    required,
)
from hybridflow.config.key_pairs import UnusedKeyWarning, check_key_pairs
from hybridflow.config.schema import ConfigError, PPOConfig, load_unvalidated
from hybridflow.utils.errors import InputError

MULTI_TURN = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "2+3=5"},
    {"role": "user", "content": "And 4+4?"},
    {"role": "assistant", "content": "4+4=8"},
]


def check_config(ctx: Context, overrides: list[str], config_path: str | None) -> Check:
    """The config resolves and is consistent; the keys set but ignored on this backend, and those set that
    have no effect without another key (``KEY_PAIRS``), are listed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IgnoredKeyWarning)
        warnings.simplefilter("always", UnusedKeyWarning)
        try:
            cfg = load_unvalidated(overrides, config_path)
            for check in (check_ranges, check_choices, check_cross_fields):
                check(cfg)
            check_key_pairs(cfg, PPOConfig())
        except ConfigError as err:
            return Check(
                "config", "fail", str(err), "correct the key named above (hybridflow train would stop there)"
            )
        try:
            cfg.validate()  # the full validation also warns for schema keys set but ignored here
        except ConfigError:
            pass  # only the batch arithmetic is left to fail: the batch check reports it

    ctx.cfg = cfg
    tr = cfg.trainer
    detail = (
        f"resolves ({len(overrides)} overrides): {cfg.algorithm.adv_estimator}, device {tr.device}, "
        f"backend {tr.backend}, {tr.n_workers} worker(s)"
    )
    ignored = _warned(caught, IgnoredKeyWarning, "ignored on this backend: ")
    unused = _warned(caught, UnusedKeyWarning)
    if not (ignored or unused):
        return Check("config", "ok", detail)
    found = [f"set but ignored here: {'; '.join(ignored)}"] if ignored else []
    found += [f"set but without effect: {'; '.join(unused)}"] if unused else []
    return Check(
        "config",
        "warn",
        f"{detail}; {'; '.join(found)}",
        "drop those keys, set what they need, or use a backend that implements them",
        {"ignored": ignored, "unused": unused},
    )


def _warned(caught: list[warnings.WarningMessage], category: type[Warning], prefix: str = "") -> list[str]:
    """The messages of the warnings of ``category``, once each, in order, without ``prefix``."""
    return list(
        dict.fromkeys(str(w.message).removeprefix(prefix) for w in caught if issubclass(w.category, category))
    )


def check_paths(ctx: Context) -> Check:
    """Every file and model folder the config names exists (or is taken for a hub id), and the run folder is
    writable."""
    from hybridflow.models.default import DEFAULT_MODEL_NAMES

    cfg = ctx.config
    missing: list[str] = []
    remote: list[str] = []
    files = [
        ("data.train_files", cfg.data.train_files),
        ("data.val_files", cfg.data.val_files),
        ("data.sft.files", cfg.data.sft.files),
    ]
    for key, paths in files:
        missing += [f"{key}: {p}" for p in paths or [] if not Path(p).is_file()]
    models: list[tuple[str, str | None]] = [
        ("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)
    ]
    if cfg.critic.enable:
        models.append(("critic.model.path", cfg.critic.model.path))
    if cfg.reward_model.enable and not cfg.reward_model.dummy:
        models.append(("reward_model.model.path", cfg.reward_model.model.path))
    if cfg.actor_rollout_ref.teacher.path:
        models.append(("actor_rollout_ref.teacher.path", cfg.actor_rollout_ref.teacher.path))
    for key, path in models:
        if path is None:  # check_config refused a model without a path
            continue
        if path.lower() in DEFAULT_MODEL_NAMES or Path(path).expanduser().is_dir():
            continue
        looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1  # as model_location decides
        (missing if looks_local else remote).append(f"{key}: {path}")
    for key, path in (
        ("custom_reward_function.path", cfg.custom_reward_function.path),
        ("trainer.resume_from_path", cfg.trainer.resume_from_path),
    ):
        if path and not Path(path).exists():
            missing.append(f"{key}: {path}")
    run_dir = Path(cfg.trainer.default_local_dir).absolute()
    parent = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not os.access(parent, os.W_OK):
        missing.append(f"trainer.default_local_dir: {run_dir} (cannot write in {parent})")
    if missing:
        return Check(
            "paths",
            "fail",
            "not found: " + "; ".join(missing),
            "point those keys at existing files (hybridflow prepare-data writes datasets)",
        )
    if remote:
        return Check(
            "paths",
            "warn",
            "not local folders, taken for Hugging Face hub ids: " + "; ".join(remote),
            "download them first if this machine is offline",
        )
    return Check("paths", "ok", f"every file and folder exists; run folder {run_dir}")


def check_model(ctx: Context) -> Check:
    """The tokenizer and the model's config load (never the weights); eos, pad and an append-only chat
    template are there; the model's shape is kept for the memory check."""
    from transformers import AutoConfig

    from hybridflow.workers.modeling import load_image_prompts, load_tokenizer, model_location

    model = ctx.config.actor_rollout_ref.model
    path = required(model.path, "actor_rollout_ref.model.path")  # check_config refused a missing one
    try:
        folder = model_location(path)
        tokenizer = load_tokenizer(path, model.trust_remote_code)
        ctx.processor = load_image_prompts(path, tokenizer, model.trust_remote_code)
        hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=model.trust_remote_code)
        ctx.shape = model_shape(hf_config, folder)
        ctx.hf_config = hf_config
    except Exception as err:  # noqa: BLE001 - any loading failure is the verdict, with its reason
        return Check(
            "model",
            "fail",
            f"{model.path} does not load: {type(err).__name__}: {err}",
            "check actor_rollout_ref.model.path points at a Hugging Face model folder",
        )
    ctx.tokenizer = tokenizer
    local = Path(folder)
    if local.is_dir() and not any(local.glob("*.safetensors")) and not any(local.glob("*.bin")):
        return Check(
            "model",
            "fail",
            f"{folder} has a config but no weights (*.safetensors or *.bin)",
            "save the model with save_pretrained into that folder",
        )
    detail = (
        f"{hf_config.model_type}, {ctx.shape.params / 1e6:.1f} M parameters, vocab {ctx.shape.vocab_size}; "
        f"eos {tokenizer.eos_token!r}, pad {tokenizer.pad_token!r}"
    )
    if tokenizer.eos_token_id is None:
        return Check(
            "model",
            "fail",
            detail + "; the tokenizer has no eos token: generation never ends",
            "set eos_token in the model folder's tokenizer_config.json",
        )
    if tokenizer.chat_template is None:
        return Check(
            "model",
            "fail",
            detail + "; the tokenizer has no chat template",
            "add a chat_template to tokenizer_config.json (prompts are rendered with it)",
        )
    problem = _not_append_only(tokenizer)
    if problem:
        return Check(
            "model",
            "warn",
            f"{detail}; chat template is not append-only: {problem}",
            "multi-turn rollouts re-render earlier turns; use a template that keeps them as they were",
        )
    return Check("model", "ok", detail + "; chat template append-only over 2 turns")


def _not_append_only(tokenizer: Any) -> str:
    """Where rendering one more message changes the text of the earlier ones ('' when it never does)."""
    for k in range(1, len(MULTI_TURN)):
        before = tokenizer.apply_chat_template(
            MULTI_TURN[:k], tokenize=False, add_generation_prompt=MULTI_TURN[k]["role"] == "assistant"
        )
        after = tokenizer.apply_chat_template(MULTI_TURN[: k + 1], tokenize=False)
        if not after.startswith(before):
            return f"adding message {k + 1} ({MULTI_TURN[k]['role']}) rewrites the text before it"
    return ""


def check_reward(ctx: Context) -> Check:
    """The reward function on each data source's first row: a right answer (in the task's own form where the
    scorer's form is known, else the ground truth in the usual answer forms) and a wrong one."""
    from hybridflow.rewards import default_compute_score, load_custom_reward_function

    custom = ctx.config.custom_reward_function
    where = f"{custom.path}:{custom.name}" if custom.path else "the built-in rule scorers (by data_source)"
    try:
        score_fn = (
            load_custom_reward_function(custom.path, custom.name) if custom.path else default_compute_score
        )
    except Exception as err:  # noqa: BLE001
        return Check(
            "reward",
            "fail",
            f"{where} does not load: {type(err).__name__}: {err}",
            "fix custom_reward_function.path / .name",
        )
    by_source = {row.data_source: row for row in reversed(ctx.rows)}  # the first row of each source
    if not by_source:
        return Check("reward", "skip", "no dataset rows to score")
    shown, all_zero = [], True
    for source, row in sorted(by_source.items(), key=lambda kv: str(kv[0])):
        scores: dict[str, float] = {}
        for kind, label, candidates in probes(row, generic_too=bool(custom.path)):
            on = f"on a {kind} response for data_source {source!r} ({row.file} row {row.row})"
            score = _score_probe(score_fn, where, on, row, candidates)
            if isinstance(score, Check):
                return score
            scores[label] = score
        all_zero &= all(v == 0 for v in scores.values())
        shown.append(f"{source}: " + ", ".join(f"{k} {v:.3g}" for k, v in scores.items()))
    detail = f"{where}: " + "; ".join(shown)
    if ctx.config.reward_model.enable:
        detail += " (the reward model itself is not run by doctor)"
    if all_zero:
        return Check(
            "reward",
            "warn",
            detail + ": 0 for the right answer too",
            "check the reward credits a right answer in your answer format",
        )
    return Check("reward", "ok", detail)


def _score_probe(score_fn: Any, where: str, on: str, row: Any, candidates: list[str]) -> float | Check:
    """The best score of ``candidates`` on ``row``; a failing Check when the function raises or returns what
    training refuses."""
    from hybridflow.rewards.manager import checked_score

    try:
        results = [score_fn(row.data_source, text, row.ground_truth, row.extra_info) for text in candidates]
    except Exception as err:  # noqa: BLE001 - the point of the check
        return Check(
            "reward",
            "fail",
            f"{where} raised {on}: {type(err).__name__}: {err}",
            "make the reward function return a number for any text (0 for unparsable)",
        )
    try:  # the rule training applies to what a scorer returns
        return max(checked_score(result, "it")["score"] for result in results)
    except InputError as err:
        return Check(
            "reward", "fail", f"{where} {on}: {err}", "return a number, or a dict with a numeric 'score'"
        )


def machine_memory(cfg: PPOConfig, memory_gb: float | None) -> tuple[float, str]:
    """Bytes one machine (GPU on CUDA) offers the workers, and where the figure comes from."""
    if memory_gb is not None:
        return memory_gb * GB, "--memory-gb"
    if cfg.trainer.device == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory, f"GPU 0 ({torch.cuda.get_device_name(0)})"
    if cfg.trainer.backend == "ray":
        import ray

        if ray.is_initialized():
            nodes = [n["Resources"].get("memory", 0) for n in ray.nodes() if n.get("Alive")]
            if nodes:
                return min(nodes), f"the smallest of {len(nodes)} Ray node(s)"
    import psutil

    memory = psutil.virtual_memory()
    return memory.total, f"this machine, {memory.available / GB:.1f} GB free now"


def check_memory(ctx: Context, memory_gb: float | None) -> Check:
    """The estimated peak memory (``memory_estimate``) against what a machine offers, naming the knob to turn
    when it does not fit."""
    cfg = ctx.config
    workers = cfg.trainer.n_workers if cfg.trainer.backend == "ray" else 1  # local: one rank in this process
    est = estimate_memory(cfg, ctx.model_shape, workers, ctx.prompt_tokens)
    available, source = machine_memory(cfg, memory_gb)
    # CPU workers share one machine's memory; GPU workers each have their own device
    per_machine = 1 if cfg.trainer.device == "cuda" else workers
    need = est.device * per_machine
    who = (
        "per GPU worker"
        if per_machine == 1 and cfg.trainer.device == "cuda"
        else f"for {per_machine} worker(s) on one machine"
    )
    detail = f"~{need / GB:.2f} GB {who} ({est.summary()}) vs {available / GB:.1f} GB ({source})"
    if est.host:
        detail += f"; {est.host / GB:.2f} GB offloaded to host memory"
    info = {"estimate_bytes": need, "available_bytes": available, "static": est.static, "passes": est.passes}
    if need > available:
        return Check("memory", "fail", detail + ": will not fit", knob(cfg, est, per_machine), info)
    if need > 0.85 * available:
        return Check("memory", "warn", detail + ": tight", knob(cfg, est, per_machine), info)
    return Check("memory", "ok", detail, data=info)


def check_environment(cfg: PPOConfig | None) -> Check:
    """Versions and devices; with ``rollout.name=vllm``, whether vLLM imports (in a child process)."""
    import torch

    versions = {name: _version(name) for name in ("torch", "transformers", "ray", "vllm")}
    detail = f"python {platform.python_version()}, " + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    devices = f"{os.cpu_count()} CPUs"
    if torch.cuda.is_available():
        devices += ", " + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    detail += f"; {devices}"
    if cfg is not None and cfg.actor_rollout_ref.rollout.name == "vllm":
        problem = _import_error("vllm")
        if problem:
            return Check(
                "environment",
                "fail",
                f"{detail}; rollout.name is vllm but it does not import: {problem}",
                "pip install 'hybridflow[vllm]' on the GPU machine, or actor_rollout_ref.rollout.name=hf",
            )
        detail += "; vllm imports"
    return Check("environment", "ok", detail)


def _import_error(module: str) -> str:
    """'' when ``module`` imports, else the last line of the error. In a child process: a GPU engine's
    import can take seconds, load CUDA libraries or crash, none of which should happen to the doctor."""
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        result = subprocess.run(
            [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return "import took over 300 s"
    lines = result.stderr.strip().splitlines()
    return (lines[-1] if lines else f"exit status {result.returncode}") if result.returncode else ""


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_checks(
    overrides: list[str], config_path: str | None = None, memory_gb: float | None = None
) -> list[Check]:
    """Every check, in order; one whose prerequisite failed is a ``skip`` naming it."""
    ctx = Context()
    checks = [check_config(ctx, overrides, config_path)]
    if ctx.cfg is None:
        return (
            checks
            + [
                Check(name, "skip", "needs a config that resolves")
                for name in ("paths", "model", "support", "dataset", "batch", "reward", "memory")
            ]
            + [check_environment(None)]
        )
    checks.append(check_paths(ctx))
    checks.append(check_model(ctx))
    checks.append(
        check_support(ctx)
        if ctx.hf_config is not None
        else Check("support", "skip", "needs the model's config")
    )
    checks.append(
        check_dataset(ctx)
        if ctx.tokenizer is not None and ctx.cfg.data.train_files
        else Check("dataset", "skip", "needs the tokenizer and data.train_files")
    )
    checks.append(check_batches(ctx))
    checks.append(check_reward(ctx))
    checks.append(
        check_memory(ctx, memory_gb)
        if ctx.shape is not None
        else Check("memory", "skip", "needs the model's config")
    )
    checks.append(check_environment(ctx.cfg))
    return checks


def main(argv: list[str] | None = None) -> int:
    """``hybridflow doctor [--json] [--memory-gb N] [--config FILE] key=value ...``: 0 when no check failed."""
    parser = argparse.ArgumentParser(
        prog="hybridflow doctor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="a YAML file merged over the packaged ppo_trainer.yaml")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    parser.add_argument(
        "--memory-gb",
        type=float,
        help="memory to plan for per machine (per GPU on cuda), instead of what this machine has",
    )
    parser.add_argument("overrides", nargs="*", help="the same key=value overrides as hybridflow train")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    checks = run_checks(args.overrides, args.config, args.memory_gb)
    failed = [c.name for c in checks if c.verdict == "fail"]
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, default=str))
    else:
        for check in checks:
            print(check.line())
        counts = Counter(c.verdict for c in checks)
        print(
            f"\n{len(checks)} checks: "
            + ", ".join(f"{counts[v]} {v}" for v in ("ok", "warn", "fail", "skip") if counts[v])
        )
    return 1 if failed else 0
