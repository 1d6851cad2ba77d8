"""Experiment tracking: one ``Tracking.log(metrics, step)`` call fans out to every chosen backend.

Backends (``trainer.logger``): ``console`` (one compact line per step, through ``tqdm.write`` so a progress
bar stays intact), ``file`` (``<log_dir>/metrics.jsonl``, one JSON object per step, flushed each step),
``tensorboard`` (``<log_dir>/tensorboard``), ``wandb`` and ``mlflow``. The last three are imported only when
asked for, with an install hint if missing.

Resuming: the JSONL file is appended to, and the first step logged after a restart drops the lines of that
step and later ones (they were logged after the checkpoint the run resumed from), so the file ends up
with one line per step as if the run had never stopped. A line that does not parse (the process died
while writing it) is dropped with a warning: a resume never depends on the log being well-formed.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from hybridflow.runs.stages import CONSOLE_TIMINGS

logger = logging.getLogger(__name__)

#: The console line's summary fields: (label, metric keys tried in order). Each trainer names its own.
ConsoleFields = tuple[tuple[str, tuple[str, ...]], ...]

#: What matters in an RL step (the PPO family's line).
CONSOLE_FIELDS: ConsoleFields = (
    ("reward", ("critic/score/mean", "critic/rewards/mean")),
    # KL to the reference policy (the tutorials' "healthy KL 0.02-0.06"), present when a reference is loaded;
    # ppo_kl: how far one update moved the policy; not logged when the data is used once, on-policy (the
    # ratio is then exactly 1, so it would be 0 by construction)
    ("kl_ref", ("actor/kl_ref", "actor/reward_kl_penalty")),
    ("ppo_kl", ("actor/ppo_kl",)),
    ("pg_loss", ("actor/pg_loss",)),
    ("vf_loss", ("critic/vf_loss",)),
    ("resp_len", ("response_length/mean",)),
)


def show_info_logs() -> None:
    """hybridflow's own INFO messages (e.g. which checkpoint a run resumed from) on stderr, other libraries'
    logging left as it is: what the training commands show."""
    log = logging.getLogger("hybridflow")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def format_step_line(step: int, metrics: Mapping[str, float], fields: ConsoleFields = CONSOLE_FIELDS) -> str:
    """``step 3 | reward 0.42 | kl_ref 0.031 | ppo_kl 0.013 | pg_loss -0.187 | resp_len 12.5 | gen 3.1s ...``.

    ``fields`` are the summary fields (the RL ones by default); missing metrics are left out; every ``val/*``
    metric present is appended as ``val/<name> <value>``.
    """
    parts = [f"step {step}"]
    for label, keys in fields:
        key = next((k for k in keys if k in metrics), None)
        if key is not None:
            parts.append(f"{label} {_short(metrics[key])}")
    timings = [f"{label} {metrics[key]:.1f}s" for label, key in CONSOLE_TIMINGS if key in metrics]
    if timings:
        parts.append(" ".join(timings))
    parts += [f"{key} {_short(value)}" for key, value in metrics.items() if key.startswith("val/")]
    return " | ".join(parts)


def _short(value: float) -> str:
    """Three significant digits, without scientific notation for everyday magnitudes."""
    return f"{value:.0f}" if 100 <= abs(value) < 1e6 else f"{value:.3g}"


class _Backend(Protocol):
    def log(self, data: dict[str, float], step: int) -> None: ...

    def finish(self) -> None: ...


class ConsoleBackend:
    """One ``format_step_line`` per step, with the trainer's summary fields."""

    def __init__(self, fields: ConsoleFields) -> None:
        self.fields = fields

    def log(self, data: dict[str, float], step: int) -> None:
        tqdm.write(format_step_line(step, data, self.fields))

    def finish(self) -> None:
        pass


class JsonlFile:
    """A JSONL file of ``{"step": N, ...}`` objects, appended and flushed each write; the first write of a
    resumed run drops the lines of that step and later ones (they were logged after the checkpoint)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: Any = None

    def write(self, step: int, rows: Iterable[Mapping[str, Any]]) -> None:
        if self._file is None:
            _drop_lines_from_step(self.path, step)
            self._file = open(self.path, "a")  # kept open for the run, closed in close()
        self._file.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class JsonlBackend:
    """``<log_dir>/metrics.jsonl``: ``{"step": N, ...metrics}`` per line, appended and flushed each step.

    ``log_records`` writes structured per-step records (the stage timeline, validation samples) the same
    way into ``<log_dir>/<name>.jsonl``, one line per record."""

    def __init__(self, project_name: str, experiment_name: str, log_dir: Path, config: dict | None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.path = log_dir / "metrics.jsonl"
        self._files = {"metrics": JsonlFile(self.path)}

    def log(self, data: dict[str, float], step: int) -> None:
        self._files["metrics"].write(step, [data])

    def log_records(self, name: str, records: list[dict[str, Any]], step: int) -> None:
        if name not in self._files:
            self._files[name] = JsonlFile(self.log_dir / f"{name}.jsonl")
        self._files[name].write(step, records)

    def finish(self) -> None:
        for file in self._files.values():
            file.close()


def _drop_lines_from_step(path: Path, step: int) -> None:
    """Rewrite ``path`` without the lines of ``step`` and later (logged after the resumed checkpoint)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and _step_of(path, lines, line) < step]
    if len(kept) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")  # one writer per run folder (RunLock): a fixed name, reused
        tmp.write_text("".join(kept))
        os.replace(tmp, path)


def _step_of(path: Path, lines: list[str], line: str) -> float:
    """The step a JSONL line was logged at; +inf (so it is dropped) for a line torn by a crash."""
    try:
        return json.loads(line).get("step", -1)
    except (json.JSONDecodeError, AttributeError):
        logger.warning(
            "%s: dropped line %d of %d, which is not a complete JSON object (the process writing it "
            "was stopped mid-line): %r",
            path,
            lines.index(line) + 1,
            len(lines),
            line[:80],
        )
        return float("inf")


class TensorBoardBackend:
    """Scalars into ``<log_dir>/tensorboard``; the config as a text summary."""

    def __init__(self, project_name: str, experiment_name: str, log_dir: Path, config: dict | None) -> None:
        writer_cls = _import("torch.utils.tensorboard", "tensorboard", "tensorboard").SummaryWriter
        self.writer = writer_cls(log_dir=str(log_dir / "tensorboard"))
        if config is not None:
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=2, default=str)}\n```")

    def log(self, data: dict[str, float], step: int) -> None:
        for key, value in data.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandbBackend:
    """A Weights & Biases run named ``experiment_name`` in ``project_name``."""

    def __init__(self, project_name: str, experiment_name: str, log_dir: Path, config: dict | None) -> None:
        self.wandb = _import("wandb", "wandb", "wandb")
        self.run = self.wandb.init(
            project=project_name, name=experiment_name, config=config, dir=str(log_dir)
        )

    def log(self, data: dict[str, float], step: int) -> None:
        self.run.log(data, step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowBackend:
    """An MLflow run named ``experiment_name`` in the experiment ``project_name``."""

    def __init__(self, project_name: str, experiment_name: str, log_dir: Path, config: dict | None) -> None:
        self.mlflow = _import("mlflow", "mlflow", "mlflow")
        self.mlflow.set_experiment(project_name)
        self.mlflow.start_run(run_name=experiment_name)
        if config is not None:
            self.mlflow.log_dict(config, "config.json")

    def log(self, data: dict[str, float], step: int) -> None:
        # MLflow metric names allow only alphanumerics and _ - . space / (no '@', as in val/x/pass@4).
        self.mlflow.log_metrics({re.sub(r"[^\w\-. /]", "_", k): v for k, v in data.items()}, step=step)

    def finish(self) -> None:
        self.mlflow.end_run()


BACKENDS: dict[str, type] = {
    "console": ConsoleBackend,
    "file": JsonlBackend,
    "tensorboard": TensorBoardBackend,
    "wandb": WandbBackend,
    "mlflow": MlflowBackend,
}


def _import(module: str, logger_name: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"trainer.logger includes {logger_name!r} but the package is not installed: pip install {package}"
        ) from None


class Tracking:
    """Log one dict of scalar metrics per step to every backend named in ``default_backend``.

    ``log_dir`` holds the file and tensorboard outputs (the run folder, ``trainer.default_local_dir``);
    ``config`` (a plain nested dict, ``PPOConfig.to_dict()``) is recorded by tensorboard, wandb and mlflow;
    ``console_fields`` are the console line's summary fields (each trainer shows what matters for it).
    """

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | Iterable[str],
        log_dir: str | os.PathLike,
        config: dict | None = None,
        console_fields: ConsoleFields = CONSOLE_FIELDS,
    ) -> None:
        names = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        unknown = [name for name in names if name not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown logger {unknown[0]!r} in trainer.logger; known: {sorted(BACKENDS)}")
        self.backends: list[_Backend] = [
            ConsoleBackend(console_fields)
            if name == "console"
            else BACKENDS[name](project_name, experiment_name, Path(log_dir), config)
            for name in dict.fromkeys(names)
        ]

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Log ``data`` (numbers, numpy scalars or one-element tensors) as step ``step``."""
        values = {key: _scalar(key, value) for key, value in data.items()}
        for backend in self.backends:
            backend.log(values, step)

    def log_records(self, name: str, records: list[dict[str, Any]], step: int) -> None:
        """JSON-serialisable records of ``step`` into ``<log_dir>/<name>.jsonl`` (``file`` logger only):
        data that is not one scalar per step, e.g. the stage ``timeline`` or ``val_generations``."""
        for backend in self.backends:
            if isinstance(backend, JsonlBackend):
                backend.log_records(name, records, step)

    def finish(self) -> None:
        """Flush and close every backend."""
        for backend in self.backends:
            backend.finish()


def _scalar(key: str, value: Any) -> int | float:
    """A plain Python int or float (bools become ints); TypeError naming the metric otherwise."""
    item = getattr(value, "item", None)
    if callable(item):  # numpy scalars and one-element arrays or tensors
        try:
            value = item()
        except (ValueError, RuntimeError):
            raise TypeError(
                f"metric {key!r} must be one number, got {type(value).__name__} of shape "
                f"{tuple(getattr(value, 'shape', ()))}"
            ) from None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}")
