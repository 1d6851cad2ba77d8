"""``RewardWorker``: the rule-based / custom reward function in a worker process of its own.

Why a worker for a plain function: with ``trainer.placement=split`` scoring runs beside the rollout and the
trainer instead of inside the driver, as the tutorials' three-process layout does, and a slow reward
(a sandbox, a remote judge) then costs the driver nothing but the wait.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register


class RewardWorker(Worker):
    """Runs ``reward_fn(data, return_dict=True)`` (a ``RewardManager`` or any callable like it); with
    ``announce`` it prints one line per batch (``[reward] scored ...``)."""

    def __init__(self, reward_fn: Callable[..., dict[str, Any]], announce: bool = True) -> None:
        super().__init__()
        self.reward_fn, self.announce = reward_fn, announce

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Nothing to load: the function arrived with the worker."""

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def compute_reward(self, data: DataProto) -> dict[str, Any]:
        """The reward function's result: ``reward_tensor`` ``(bs, L)``, ``reward_extra_info``, ``metrics``."""
        result = self.reward_fn(data, return_dict=True)
        if self.announce:
            scores = result["reward_tensor"].sum(-1)
            spread = float(scores.std()) if len(scores) > 1 else 0.0
            print(
                f"[reward] scored {len(scores)} responses: mean {float(scores.mean()):.2f} +- {spread:.2f} "
                f"(pid {os.getpid()})",
                flush=True,
            )
        return result
