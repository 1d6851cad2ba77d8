"""A replay buffer of DataProto rows with uniform or prioritized sampling, and a step-wise sampling schedule.

Why: off-policy reuse of rollouts (replaying hard prompts, mixing old and fresh samples) is a few lines of
driver code once the buffer speaks ``DataProto``: push a step's batch, sample a training batch, feed the
new per-row priorities (e.g. ``|advantage|``) back.  Prioritized sampling follows Schaul et al. 2016,
"Prioritized Experience Replay": ``P(i) = p_i^alpha / sum_j p_j^alpha`` with importance-sampling weights
``w_i = (N * P(i))^-beta`` normalised so the largest weight any row could get is 1 (updates are only
scaled down, never up).

Rows are addressed by stable ids: every pushed row gets the next integer, and since eviction is FIFO
the rows in the buffer always hold the contiguous ids ``[next_id - len(buffer), next_id)``.  A trainer
that updates priorities after the rows it sampled were evicted is told how many were skipped instead
of silently touching whichever rows moved into those slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from hybridflow.protocol import DataProto

__all__ = ["ReplayBuffer", "ScheduledSampler", "importance_weights", "priority_probabilities"]

STRATEGIES = ("uniform", "priority")
IS_WEIGHTS_KEY = "is_weights"


def priority_probabilities(priorities: np.ndarray, alpha: float) -> np.ndarray:
    """Sampling probabilities ``P(i) = p_i^alpha / sum_j p_j^alpha`` for priorities of shape ``(N,)``.

    ``alpha = 0`` is uniform, ``alpha = 1`` is proportional to the priority.  Rows of priority 0 are
    never drawn (for ``alpha > 0``); all-zero priorities leave nothing to sample and raise."""
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    scaled = np.power(np.asarray(priorities, dtype=np.float64), alpha)
    total = scaled.sum()
    if not total > 0:
        raise ValueError(f"cannot sample by priority: all {len(scaled)} priorities are zero")
    probabilities: np.ndarray = scaled / total
    return probabilities


def importance_weights(probabilities: np.ndarray, indices: np.ndarray, beta: float) -> np.ndarray:
    """Importance weights ``(N * P(i))^-beta / max_j (N * P(j))^-beta`` of the drawn ``indices``.

    ``probabilities`` has shape ``(N,)`` (the whole buffer); the maximum is taken over every row that can
    be drawn (``P(j) > 0``), so a row's weight does not depend on which other rows were drawn with it.
    Returns float64 of shape ``indices.shape``, each in ``(0, 1]``."""
    smallest = probabilities[probabilities > 0].min()
    weights: np.ndarray = np.power(probabilities[indices] / smallest, -beta)
    return weights


def _as_priorities(priorities: np.ndarray | float, n: int, what: str) -> np.ndarray:
    """Priorities for ``n`` rows as float64 ``(n,)`` (a scalar applies to all); finite and >= 0."""
    values = (
        np.full(n, priorities, dtype=np.float64)
        if np.ndim(priorities) == 0
        else np.asarray(priorities, dtype=np.float64)
    )
    if values.shape != (n,):
        raise ValueError(f"{what}: got priorities of shape {values.shape} for {n} rows")
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
    if bad.size:
        raise ValueError(
            f"{what}: priorities must be finite and >= 0; bad at positions {bad[:10].tolist()} "
            f"(values {values[bad[:10]].tolist()})"
        )
    return values


class ReplayBuffer:
    """At most ``capacity`` DataProto rows with FIFO eviction and uniform or prioritized sampling.

    Every push must have the same tensor and non-tensor keys, and each tensor the same per-row shape and
    dtype as the rows already stored (pad responses to a fixed length before pushing).  ``seed`` makes
    sampling deterministic: two buffers with the same seed and the same pushes draw the same rows.
    """

    def __init__(self, capacity: int, seed: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"ReplayBuffer capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._rng = np.random.default_rng(seed)
        # Rows live in pushed chunks; the first `_head` rows of `_chunks[0]` are already evicted.
        # `_rows()` concatenates lazily, so a push costs a copy of the pushed rows only.
        self._chunks: list[DataProto] = []
        self._head = 0
        self._priorities = np.zeros(0, dtype=np.float64)
        self._next_id = 0
        self._meta_info: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self._priorities)

    def __repr__(self) -> str:
        return f"ReplayBuffer(len={len(self)}, capacity={self.capacity}, next_id={self._next_id})"

    # ------------------------------------------------------------------ writing
    def push(self, data: DataProto, priorities: np.ndarray | float | None = None) -> np.ndarray:
        """Copy the rows of ``data`` in; returns their ids, shape ``(len(data),)``.

        ``priorities``: one per row, one for all, or ``None`` for the current maximum priority (1.0 when
        the buffer is empty or all its priorities are 0), so new rows are likely to be drawn soon.  When the buffer overflows, the oldest
        rows leave first.  ``meta_info`` (less ``metrics``) of the latest push is kept and handed out
        with sampled batches (sampling settings such as the temperature stay available)."""
        n = len(data)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        self._check_schema(data)
        if priorities is None:
            priorities = self._priorities.max() if len(self) and self._priorities.max() > 0 else 1.0
        new = _as_priorities(priorities, n, "push")
        self._chunks.append(
            DataProto(
                batch=data.batch.clone() if data.batch is not None else None,
                non_tensor_batch={k: v.copy() for k, v in data.non_tensor_batch.items()},
            )
        )
        self._priorities = np.concatenate([self._priorities, new])
        self._meta_info = {k: v for k, v in data.meta_info.items() if k != "metrics"}
        ids = np.arange(self._next_id, self._next_id + n, dtype=np.int64)
        self._next_id += n
        self._evict()
        return ids

    def _check_schema(self, data: DataProto) -> None:
        """Same keys, per-row shapes and dtypes as the stored rows, or a ValueError naming the culprits."""
        if not self._chunks:
            return
        ref = self._chunks[0]
        have, got = set(ref.keys()), set(data.keys())
        if have != got:
            raise ValueError(
                f"push: keys differ from the rows in the buffer: missing {sorted(have - got)}, "
                f"unexpected {sorted(got - have)}"
            )
        if ref.batch is None:
            return
        for key, stored in ref.batch.items():
            new = data.tensors[key]
            if new.shape[1:] != stored.shape[1:] or new.dtype != stored.dtype:
                raise ValueError(
                    f"push: tensor {key!r} has per-row shape {tuple(new.shape[1:])} and dtype {new.dtype}, "
                    f"but the buffer holds {tuple(stored.shape[1:])} {stored.dtype}; pad every push to the "
                    "same length (e.g. the rollout's response_length) and keep the dtype"
                )

    def _evict(self) -> None:
        """Drop the oldest rows beyond ``capacity`` (whole chunks where possible, else advance ``_head``)."""
        excess = len(self) - self.capacity
        if excess <= 0:
            return
        self._priorities = self._priorities[excess:]
        while excess:
            remaining = len(self._chunks[0]) - self._head
            if excess >= remaining:
                self._chunks.pop(0)
                self._head, excess = 0, excess - remaining
            else:
                self._head, excess = self._head + excess, 0

    def _rows(self) -> DataProto:
        """Every stored row as one DataProto, oldest first (concatenated once per batch of pushes)."""
        if len(self._chunks) > 1 or self._head:
            first = self._chunks[0][self._head :]
            self._chunks, self._head = [DataProto.concat([first, *self._chunks[1:]])], 0
        return self._chunks[0]

    @property
    def oldest_id(self) -> int:
        """Id of the oldest row still stored; ids below it were evicted."""
        return self._next_id - len(self)

    # ------------------------------------------------------------------ sampling
    def sample(
        self,
        n: int,
        strategy: str = "uniform",
        alpha: float = 0.6,
        beta: float = 0.4,
        replace: bool = True,
    ) -> tuple[DataProto, np.ndarray, np.ndarray]:
        """Draw ``n`` rows; returns ``(rows, ids, weights)``.

        ``ids`` (int64, ``(n,)``) are what ``update_priorities`` takes.  ``weights`` (float64, ``(n,)``)
        are 1 for ``uniform`` and the importance-sampling weights for ``priority``; they are also in
        ``rows.batch["is_weights"]`` (float32, ``(n,)``) so a loss can multiply per-sample terms by them
        without carrying a second object around.  ``alpha`` and ``beta`` only matter for ``priority``."""
        size = len(self)
        if size == 0:
            raise ValueError("cannot sample from an empty ReplayBuffer; push rows first")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown sampling strategy {strategy!r}; known: {list(STRATEGIES)}")
        if not replace and n > size:
            raise ValueError(f"cannot draw {n} rows without replacement from a buffer of {size}")
        if strategy == "uniform":
            positions = self._rng.choice(size, size=n, replace=replace)
            weights = np.ones(n, dtype=np.float64)
        else:
            probs = priority_probabilities(self._priorities, alpha)
            drawable = int(np.count_nonzero(probs))
            if not replace and n > drawable:
                raise ValueError(
                    f"cannot draw {n} rows without replacement: only {drawable} of {size} rows "
                    "have a priority above zero"
                )
            positions = self._rng.choice(size, size=n, replace=replace, p=probs)
            weights = importance_weights(probs, positions, beta)
        rows = self._rows()[positions]
        rows.meta_info = dict(self._meta_info)
        is_weights = torch.from_numpy(weights.astype(np.float32))
        if rows.batch is None:
            rows.batch = TensorDict({IS_WEIGHTS_KEY: is_weights}, batch_size=[n])
        else:
            rows.batch[IS_WEIGHTS_KEY] = is_weights
        return rows, positions.astype(np.int64) + self.oldest_id, weights

    def update_priorities(self, ids: Sequence[int] | np.ndarray, priorities: np.ndarray | float) -> int:
        """Set the priorities of rows by id (as returned by ``sample``/``push``); returns how many ids
        were skipped because their rows have been evicted since.  A repeated id takes its last value.
        Ids never handed out are an error (they point at a bug, not at eviction)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        values = _as_priorities(priorities, ids.size, "update_priorities")
        unknown = ids[(ids >= self._next_id) | (ids < 0)]
        if unknown.size:
            raise ValueError(
                f"update_priorities: ids {unknown[:10].tolist()} were never handed out "
                f"(ids so far: 0..{self._next_id - 1})"
            )
        live = ids >= self.oldest_id
        self._priorities[ids[live] - self.oldest_id] = values[live]
        return int(ids.size - live.sum())

    @property
    def priorities(self) -> np.ndarray:
        """Priorities of the stored rows, oldest first, shape ``(len(self),)`` (a copy)."""
        priorities: np.ndarray = self._priorities.copy()
        return priorities

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: rows, priorities, ids and the sampler's random state."""
        return {
            "rows": self._rows() if len(self) else None,
            "priorities": self._priorities.copy(),
            "next_id": self._next_id,
            "meta_info": dict(self._meta_info),
            "rng_state": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``; a smaller ``capacity`` than the saved rows evicts the oldest."""
        rows, priorities = state["rows"], np.asarray(state["priorities"], dtype=np.float64)
        if (len(rows) if rows is not None else 0) != len(priorities):
            raise ValueError(
                f"load_state_dict: {len(rows) if rows is not None else 0} rows but "
                f"{len(priorities)} priorities"
            )
        self._chunks, self._head = ([rows] if rows is not None else []), 0
        self._priorities = priorities.copy()
        self._next_id = int(state["next_id"])
        self._meta_info = dict(state["meta_info"])
        self._rng.bit_generator.state = state["rng_state"]
        self._evict()


@dataclasses.dataclass(frozen=True)
class _Phase:
    until_step: int | None
    strategy: str
    alpha: float
    beta: float


class ScheduledSampler:
    """A sampling strategy that changes with the training step.

    ``schedule`` is a list of phases, each a dict with ``until_step`` (exclusive; omitted on the last
    phase, which runs forever) and any of ``strategy``, ``alpha``, ``beta``; keys a phase omits take
    the constructor's defaults.  Example: uniform while the buffer fills, then prioritized::

        ScheduledSampler([{"until_step": 1000, "strategy": "uniform"},
                          {"until_step": 5000, "strategy": "priority", "alpha": 0.6},
                          {"strategy": "priority", "alpha": 0.8}])
    """

    def __init__(
        self,
        schedule: Sequence[Mapping[str, Any]],
        strategy: str = "uniform",
        alpha: float = 0.6,
        beta: float = 0.4,
    ) -> None:
        if not schedule:
            raise ValueError("ScheduledSampler needs at least one phase")
        defaults = {"strategy": strategy, "alpha": alpha, "beta": beta}
        self.phases = [
            _parse_phase(i, phase, defaults, last=i == len(schedule) - 1) for i, phase in enumerate(schedule)
        ]
        bounds = [
            p.until_step for p in self.phases[:-1] if p.until_step is not None
        ]  # all but the last have one
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"ScheduledSampler: until_step values must increase, got {bounds}")

    @classmethod
    def from_config(cls, replay_buffer: Any) -> ScheduledSampler:
        """From the ``replay_buffer`` config section (``ReplayBufferConfig``, or anything with its attributes
        ``strategy``, ``alpha``, ``beta``, ``schedule``); a null ``schedule`` gives one constant phase.

        Config phases may be dataclasses or mappings, and a null value counts as omitted.  When the last
        phase has an ``until_step`` (as every entry of ``replay_buffer.schedule`` does), the top-level
        ``strategy``/``alpha``/``beta`` cover the steps after it."""
        phases = [_phase_dict(p) for p in replay_buffer.schedule or []]
        if not phases or "until_step" in phases[-1]:
            phases.append({})
        return cls(
            phases,
            strategy=replay_buffer.strategy,
            alpha=float(replay_buffer.alpha),
            beta=float(replay_buffer.beta),
        )

    def params(self, step: int) -> dict[str, Any]:
        """``{"strategy", "alpha", "beta"}`` in force at ``step``."""
        phase = next(p for p in self.phases if p.until_step is None or step < p.until_step)
        return {"strategy": phase.strategy, "alpha": phase.alpha, "beta": phase.beta}

    def sample(
        self, buffer: ReplayBuffer, n: int, step: int, replace: bool = True
    ) -> tuple[DataProto, np.ndarray, np.ndarray]:
        """``buffer.sample`` with the parameters in force at ``step``."""
        return buffer.sample(n, replace=replace, **self.params(step))


def _phase_dict(phase: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A config phase (mapping or dataclass) as a dict without its null values."""
    items = dict(phase) if isinstance(phase, Mapping) else dataclasses.asdict(phase)
    return {k: v for k, v in items.items() if v is not None}


def _parse_phase(index: int, phase: Mapping[str, Any], defaults: dict[str, Any], last: bool) -> _Phase:
    unknown = set(phase) - {"until_step", *defaults}
    if unknown:
        raise ValueError(
            f"schedule phase {index} has unknown keys {sorted(unknown)}; "
            f"allowed: until_step, strategy, alpha, beta"
        )
    until = phase.get("until_step")
    if last and until is not None:
        raise ValueError(
            f"the last schedule phase ({index}) must omit until_step: it covers every later step"
        )
    if not last and until is None:
        raise ValueError(f"schedule phase {index} needs until_step (only the last phase may omit it)")
    merged = {**defaults, **{k: v for k, v in phase.items() if k != "until_step"}}
    if merged["strategy"] not in STRATEGIES:
        raise ValueError(
            f"schedule phase {index}: unknown strategy {merged['strategy']!r}; known: {list(STRATEGIES)}"
        )
    return _Phase(
        until_step=None if until is None else int(until),
        strategy=merged["strategy"],
        alpha=float(merged["alpha"]),
        beta=float(merged["beta"]),
    )
