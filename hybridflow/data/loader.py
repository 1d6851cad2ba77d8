"""Batching prompts into DataProto, with a loader whose position can be checkpointed.

Why a custom loader: a resumed run must see exactly the batch it would have seen had it not
stopped. The order of each epoch is a pure function of (seed, epoch), so the loader's whole state
is two integers and resuming needs no replay of earlier batches.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.utils.errors import InputError


class Rows(Protocol):
    """What a loader reads: rows by index, and how many there are (a map-style torch Dataset with a length)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


D = TypeVar("D", bound=Rows)  # the dataset a loader reads: its own type (RLHFDataset, an offline one...)


def collate_fn(items: Sequence[dict[str, Any]]) -> DataProto:
    """Stack dataset items into one DataProto.

    Tensors (each `(max_prompt_length,)`) become `(bs, P)` entries of `batch`, P the longest prompt
    of this batch (columns that are padding in every row are dropped: every later pass pays for them);
    everything else becomes a numpy object array in `non_tensor_batch`. Each prompt also gets a
    fresh `uid` (uuid4 string) that groups its sampled responses, e.g. for GRPO's group baseline.
    """
    if not items:
        raise ValueError("collate_fn needs at least one item")
    keys = list(items[0])
    for i, item in enumerate(items):
        if list(item) != keys:
            raise ValueError(f"collate_fn: item {i} has keys {sorted(item)}, item 0 has {sorted(keys)}")
    tensors = {
        k: torch.stack([item[k] for item in items]) for k in keys if isinstance(items[0][k], torch.Tensor)
    }
    tensors = _trim_left_padding(tensors)
    non_tensors = {k: [item[k] for item in items] for k in keys if k not in tensors}
    non_tensors["uid"] = [str(uuid.uuid4()) for _ in items]
    return DataProto.from_dict(tensors, non_tensors)


def _trim_left_padding(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the leading columns that are padding in every row of the batch.

    Prompts are left-padded to max_prompt_length, but every later pass (generation, log-probs,
    training) pays for each column: a batch whose longest prompt is 80 tokens should be 80 wide,
    not 512. Position ids are unaffected (padding sits at position 0)."""
    mask = tensors.get("attention_mask")
    if mask is None or mask.dim() != 2 or not mask.any():
        return tensors
    first = int(mask.any(dim=0).int().argmax())
    width = mask.shape[1]
    return {k: v[:, first:] if v.dim() == 2 and v.shape[1] == width else v for k, v in tensors.items()}


class PromptLoader(Generic[D]):
    """Batches of a dataset as DataProto, epoch after epoch, resumable from `state_dict()`.

    Each `iter(loader)` yields the rest of the current epoch; the next `iter` starts the next epoch
    with a new order. Epoch `e` is shuffled with `numpy.random.default_rng([seed, e])`, so the order
    does not depend on how many batches were drawn before. `len(loader)` is the number of batches per
    epoch; with `drop_last=False` the last batch of an epoch may be smaller.
    """

    def __init__(
        self,
        dataset: D,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 42,
        drop_last: bool = True,
        collate: Callable[[Sequence[Any]], DataProto] = collate_fn,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if len(dataset) < batch_size:
            raise InputError(
                f"the dataset has {len(dataset)} rows, fewer than batch_size={batch_size}: "
                "use a smaller batch size or more rows"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate = collate  # items -> DataProto; the offline datasets bring their own
        self.epoch = 0
        self.position = 0  # batches of `epoch` already yielded

    def __len__(self) -> int:
        rounding = math.floor if self.drop_last else math.ceil
        return int(rounding(len(self.dataset) / self.batch_size))

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices in the order epoch `epoch` visits them."""
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def __iter__(self) -> Iterator[DataProto]:
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = self.epoch_order(self.epoch)
        while self.position < len(self):
            rows = order[self.position * self.batch_size : (self.position + 1) * self.batch_size]
            self.position += 1  # before the yield, so a checkpoint taken on this batch resumes after it
            yield self.collate([self.dataset[int(i)] for i in rows])

    def state_dict(self) -> dict[str, int | bool]:
        """Where the loader stands, plus the settings that give positions their meaning."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_rows": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Resume at `state`; refuses a state saved with another dataset size, batch size, seed or shuffle."""
        for key in ("seed", "shuffle", "batch_size", "num_rows"):
            mine = self.state_dict()[key]
            if state.get(key) != mine:
                raise ValueError(
                    f"loader state has {key}={state.get(key)!r} but this loader has {key}={mine!r}"
                )
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"loader state position {state['position']} is outside 0..{len(self)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
