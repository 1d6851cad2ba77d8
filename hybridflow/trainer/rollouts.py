"""Where a training step's samples come from: the contract (``Rollouts``) that the lock-step source here and
the asynchronous producer (``async_rollout.py``) both follow, and ``build_rollouts``, which picks one by
``async_training.mode``.

The trainer opens the run's prompt stream and ``start``s the source once, when training starts; each step
``take``s its batch (generated on the spot in lock-step, the oldest finished one asynchronously), validation
``generate_now``s, every update ``post_weights`` its new version, and the run ends with ``stop``.
"""

from __future__ import annotations

from typing import Any, Protocol

from hybridflow.protocol import DataProto
from hybridflow.rollout import tag_weight_versions
from hybridflow.single_controller import WorkerGroup
from hybridflow.trainer.async_rollout import AsyncRollouts, PromptStream
from hybridflow.trainer.dynamic_sampling import GroupFilter
from hybridflow.trainer.weight_transport import WeightTransport


class Rollouts(Protocol):
    """A source of training batches, as ``PPOTrainer`` drives it."""

    def start(self, stream: PromptStream, version: int, end: int) -> None:
        """Begin at batch ``version`` (the trainer's step, its weights posted) of ``stream``; ``end``: the run's
        last step (excluded)."""

    def take(self, index: int, prompts: DataProto, metrics: dict[str, float], timings: Any) -> DataProto:
        """Batch ``index`` (``prompts``, already drawn from the stream), generated; ``metrics`` and ``timings``
        receive what the source reports."""

    def generate_now(self, prompts: DataProto, version: int) -> DataProto:
        """A generation outside training (validation) with the weights of ``version``."""

    def post_weights(self, version: int) -> dict[str, float]:
        """The actor's weights after ``version`` steps, for whatever generates next; returns what the sync
        cost (``weight_sync/*``; empty when the rollout samples from the actor's module itself)."""

    def stop(self) -> None:
        """End the source (an asynchronous producer's thread stops after its current generation)."""


class SyncRollouts:
    """Lock-step: the trainer generates each batch when it needs it, with its current weights; a rollout
    worker of its own (``placement=split``) is sent them through ``weights`` after each update; ``refill``
    (dynamic sampling) scores each batch and refills it with more of the step's prompts."""

    def __init__(
        self,
        generator: WorkerGroup,
        weights: WeightTransport | None,
        n: int,
        refill: GroupFilter | None = None,
    ) -> None:
        self.generator, self.weights, self.n, self.refill = generator, weights, n, refill

    def start(self, stream: PromptStream, version: int, end: int) -> None:
        self.stream = stream

    def take(self, index: int, prompts: DataProto, metrics: dict[str, float], timings: Any) -> DataProto:
        def generate(part: DataProto) -> DataProto:
            part.meta_info.update(global_step=index, n=self.n)
            return tag_weight_versions(self.generator.generate_sequences(part), index)

        if self.refill is None:
            return generate(prompts)
        return self.refill.fill(prompts, generate, lambda: self.stream.more(index))

    def generate_now(self, prompts: DataProto, version: int) -> DataProto:
        """A generation outside training (validation) with the trainer's current weights."""
        return self.generator.generate_sequences(prompts)

    def post_weights(self, version: int) -> dict[str, float]:
        """A rollout worker of its own (``placement=split``) is sent the new weights; a rollout in the
        actor's process samples from the trained module itself. Returns what the sync cost."""
        return self.weights.send(version, staged=False) if self.weights is not None else {}

    def stop(self) -> None:
        pass


def build_rollouts(
    config: Any, generator: WorkerGroup, weights: WeightTransport | None, refill: GroupFilter | None = None
) -> Rollouts:
    """The source of ``async_training.mode``: ``weights`` moves the actor's weights to ``generator`` when it is
    a rollout worker of its own (None: the rollout shares the actor's module); ``refill``: dynamic sampling, or
    None."""
    run, n = config.async_training, config.actor_rollout_ref.rollout.n
    if run.mode == "sync":
        return SyncRollouts(generator, weights, n, refill)
    if run.mode == "one_step_off":
        return AsyncRollouts(generator, weights, n, 1, exact=True, refill=refill)
    return AsyncRollouts(
        generator, weights, n, run.max_staleness, exact=not run.partial_rollout, refill=refill
    )
