"""``RunLoop``: the one loop every trainer runs (PPO and its family, SFT, DPO, KTO); each supplies its step.

What a run is, whatever it trains: it owns its run folder (``RunLock``: a second run there is refused), logs to
the tracker (console line, JSONL, TensorBoard...), resumes from the newest intact checkpoint (refusing one saved
with other data settings), validates before training, then steps until ``total_steps``: validate on
``trainer.test_freq``, save on ``trainer.save_freq`` and at the end, call the user's hooks between steps, and
move the progress bar. A trainer subclasses ``RunLoop`` and fills in what differs:

- ``init_workers()``: build ``self.wg`` (the worker groups) unless given;
- ``train_step(batch, metrics, timings)``: one step on a batch of ``self.train_loader`` (or of ``batches()``);
- ``validate(tracker)``: held-out metrics (``val/...``), when ``has_validation``;
- ``save_state(folder)`` / ``load_state(folder, state)``: the workers' checkpoints and the trainer's own state
  beyond the step and the data position, which the loop saves and restores itself;
- ``step_metrics()``: scalars logged every step beside ``training/global_step`` (e.g. the KL coefficient).

The hooks (``register_hook``, ``EVENTS``) are the loop's too: user code called between stages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from hybridflow.config.sections import TrainerConfig
from hybridflow.data import PromptLoader
from hybridflow.protocol import DataProto
from hybridflow.runs.checkpoint import CheckpointManager
from hybridflow.runs.lock import RunLock
from hybridflow.runs.tracking import CONSOLE_FIELDS, ConsoleFields, Tracking
from hybridflow.trainer.metrics import StepTimings, timer
from hybridflow.trainer.worker_groups import WorkerGroups
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------- hooks
# Callbacks on training events: user code that reads the step's metrics and batch and may act.
#
# A hook is ``fn(trainer, step, metrics, batch)``; it may call trainer methods such as ``adapt_lr``. A hook
# that raises stops the run with a ``HookError`` naming the hook and the event; hooks run where the
# trainer's state is consistent (between stages), so the last complete checkpoint stays valid.

EVENTS = (
    "on_fit_start",
    "on_step_start",
    "after_generate",
    "after_reward",
    "after_advantage",
    "on_step_end",
    "on_validation_end",
    "on_checkpoint",
    "on_fit_end",
)
EVENT_ALIASES = {"on_batch_end": "on_step_end"}  # the tutorials' name

Hook = Callable[[Any, int, dict[str, Any], Any], None]


class HookError(RuntimeError):
    """A user hook raised; the message names the hook, the event and the step."""


class HookRegistry:
    def __init__(self) -> None:
        self._hooks: dict[str, list[Hook]] = {event: [] for event in EVENTS}

    def register(self, event: str, fn: Hook) -> None:
        event = EVENT_ALIASES.get(event, event)
        if event not in self._hooks:
            raise ValueError(
                f"unknown hook event {event!r}; known: {', '.join(EVENTS + tuple(EVENT_ALIASES))}"
            )
        if not callable(fn):
            raise TypeError(f"hook for {event!r} must be callable, got {fn!r}")
        self._hooks[event].append(fn)

    def emit(self, event: str, trainer: Any, step: int, metrics: dict[str, Any], batch: Any = None) -> None:
        for fn in self._hooks[event]:
            try:
                fn(trainer, step, metrics, batch)
            except Exception as e:
                name = getattr(fn, "__qualname__", repr(fn))
                raise HookError(f"hook {name!r} on {event!r} raised at step {step}: {e!r}") from e


#: A checkpoint's data position means something only for the same rows, batch size and order.
_DATA_SETTINGS = {
    "batch_size": "data.train_batch_size",
    "num_rows": "the number of training rows",
    "seed": "data.seed",
    "shuffle": "data.shuffle",
}


class RunLoop:
    """The run around a trainer's step; see the module docstring for what a subclass supplies."""

    name = "training"  #: the progress bar's label
    console_fields: ConsoleFields = CONSOLE_FIELDS  #: the console line's summary fields (label, metric keys)
    train_loader: PromptLoader[Any]
    total_steps: int

    def __init__(
        self, trainer: TrainerConfig, config_dict: dict[str, Any], worker_groups: WorkerGroups | None
    ):
        self.run = trainer
        self._config_dict = config_dict  # what the tracker records (TensorBoard, W&B, MLflow)
        self.hooks = HookRegistry()
        # the first save checks that every worker sees the run folder (on a cluster it must be shared)
        self.checkpoints = CheckpointManager(
            trainer.default_local_dir,
            trainer.max_ckpt_to_keep,
            check_root=lambda root: self.groups.check_shared_folder(root),
        )
        self.global_step = 0
        self.wg = worker_groups

    @property
    def groups(self) -> WorkerGroups:
        """``wg`` where the workers must be running: a RuntimeError before ``init_workers()`` or after ``close()``."""
        if self.wg is None:
            raise RuntimeError(
                f"{type(self).__name__} has no workers: call init_workers() first (or after close())"
            )
        return self.wg

    # ------------------------------------------------------------------ what a trainer supplies
    def init_workers(self) -> None:
        raise NotImplementedError

    def train_step(self, batch: DataProto, metrics: dict[str, float], timings: StepTimings) -> DataProto:
        raise NotImplementedError

    @property
    def has_validation(self) -> bool:
        return False

    def validate(self, tracker: Tracking | None = None) -> dict[str, float]:
        return {}

    def save_state(self, folder: Path) -> dict[str, Any]:
        raise NotImplementedError

    def load_state(self, folder: Path, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def step_metrics(self) -> dict[str, float]:
        return {}

    def data_position(self) -> dict[str, Any]:
        """What a checkpoint records as the data position: the loader's (a trainer that draws batches ahead
        of training says where the trained ones end)."""
        return self.train_loader.state_dict()

    def batches(self) -> Iterator[DataProto]:
        """The training batches, across epochs, from the (resumable) position of ``train_loader``."""
        return endless(self.train_loader)

    # ------------------------------------------------------------------ user API
    def register_hook(self, event: str, fn: Hook) -> None:
        """Call ``fn(trainer, step, metrics, batch)`` on ``event`` (see ``EVENTS``)."""
        self.hooks.register(event, fn)

    def adapt_lr(self, scale: float) -> float:
        """Multiply the actor's learning rate by ``scale`` from the next update on; returns the new lr."""
        new_lr: float = self.groups.actor_rollout.scale_lr(scale)[0]
        return new_lr

    def close(self) -> None:
        """Stop the workers this trainer started (Ray actors give their CPUs/GPUs back). The trained
        weights live in the workers: save or use them first. ``with Trainer(cfg) as t:`` closes too."""
        if self.wg is not None:
            self.wg.shutdown()
            self.wg = None

    def __enter__(self) -> RunLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """``global_step_N/``: the workers' checkpoints and ``trainer_state.pt``, written atomically."""
        with self.checkpoints.saving(self.global_step) as folder:
            state = self.save_state(folder)
            state.update(global_step=self.global_step, loader=self.data_position())
            torch.save(state, folder / "trainer_state.pt")
        self.hooks.emit("on_checkpoint", self, self.global_step, {}, None)
        return self.checkpoints.path(self.global_step)

    def load_checkpoint(self) -> None:
        """Restore ``trainer.resume_mode``'s checkpoint: ``auto`` the run folder's newest intact one (none:
        start fresh), ``resume_path`` the complete checkpoint or run folder ``resume_from_path``.

        The run folder's ``.tmp-*`` leftovers of a save that a killed process never finished are deleted; with
        ``auto``, a damaged newer checkpoint is set aside (the run resumes from the previous one), and the
        latest-step file and ``max_ckpt_to_keep`` are repaired. A checkpoint saved with other data settings is
        refused, naming them. Optimiser settings changed since the save (lr, betas, weight decay, schedule)
        apply from here on; the change is logged by the workers."""
        folder = self.checkpoints.to_resume(self.run.resume_mode, self.run.resume_from_path)
        if folder is None:
            return
        state = torch.load(folder / "trainer_state.pt", weights_only=False)
        self._check_same_data(folder, state["loader"])
        self.load_state(folder, state)
        self.global_step = state["global_step"]
        self.train_loader.load_state_dict(state["loader"])
        logger.info("resumed from %s at step %d", folder, self.global_step)

    def _check_same_data(self, folder: Path, saved: dict[str, Any]) -> None:
        """Refuse to resume with other rows, batch size or order, naming the keys, rather than fail deep in
        the loader (or silently train on other data)."""
        mine = self.train_loader.state_dict()
        changed = [
            f"{name} {saved.get(key)!r} -> {mine[key]!r}"
            for key, name in _DATA_SETTINGS.items()
            if saved.get(key) != mine[key]
        ]
        if changed:
            raise UserError(
                f"cannot resume from {folder}: it was saved with other data settings ("
                f"{', '.join(changed)}); resume with the saved values, or start a new run in another "
                "trainer.default_local_dir (or set trainer.resume_mode=disable)"
            )

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train for ``total_steps``; returns the last step's metrics (validation included)."""
        with RunLock(self.run.default_local_dir):  # held until the run ends (or its process dies)
            self.init_workers()
            tracker = Tracking(
                self.run.project_name,
                self.run.experiment_name,
                self.run.logger,
                self.run.default_local_dir,
                self._config_dict,
                console_fields=self.console_fields,
            )
            try:
                return self._fit(tracker)
            finally:
                tracker.finish()  # flushed and closed even when a step or a hook raises

    def _fit(self, tracker: Tracking) -> dict[str, float]:
        """Resume, validate, train."""
        self.load_checkpoint()
        self.hooks.emit("on_fit_start", self, self.global_step, {}, None)
        metrics: dict[str, float] = {}
        fresh = self.global_step == 0
        if self.has_validation and (self.run.val_only or self.run.val_before_train and fresh):
            metrics = self._validate(tracker)
            tracker.log(metrics, step=self.global_step)
        if not self.run.val_only:
            metrics = self._train(tracker)
        self.hooks.emit("on_fit_end", self, self.global_step, metrics, None)
        return metrics

    def _validate(self, tracker: Tracking) -> dict[str, float]:
        metrics = self.validate(tracker)
        self.hooks.emit("on_validation_end", self, self.global_step, metrics, None)
        return metrics

    def _train(self, tracker: Tracking) -> dict[str, float]:
        """Steps from ``global_step`` to ``total_steps``: train, validate, log, checkpoint."""
        batches = self.batches()
        metrics: dict[str, float] = {}
        with tqdm(total=self.total_steps, initial=self.global_step, desc=self.name, unit="step") as bar:
            while self.global_step < self.total_steps:
                metrics, timings = {}, StepTimings()
                batch = next(batches)
                self.hooks.emit("on_step_start", self, self.global_step, metrics, batch)
                batch = self.train_step(batch, metrics, timings)
                self.global_step += 1
                last = self.global_step == self.total_steps
                if self.has_validation and (last or _every(self.run.test_freq, self.global_step)):
                    with timer("validate", timings):
                        metrics.update(self._validate(tracker))
                metrics["training/global_step"] = self.global_step
                metrics["training/epoch"] = self.train_loader.epoch
                metrics.update(self.step_metrics())
                tracker.log(metrics, step=self.global_step)
                self.hooks.emit("on_step_end", self, self.global_step, metrics, batch)
                if last or _every(self.run.save_freq, self.global_step):
                    with timer("checkpoint", timings):
                        self.save_checkpoint()
                tracker.log_records("timeline", timings.spans, step=self.global_step)
                bar.update(1)
        return metrics


def endless(loader: PromptLoader[Any]) -> Iterator[DataProto]:
    """Batches across epochs; each pass over the loader continues from its (resumable) position."""
    while True:
        yield from loader


def _every(freq: int, step: int) -> bool:
    """Whether a ``*_freq`` cadence falls on ``step`` (``freq <= 0`` means never)."""
    return freq > 0 and step % freq == 0
