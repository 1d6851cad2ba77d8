"""A ``TwoStageReward`` as the trainer's ``reward_fn``: token-level scores plus the stages' metrics.

The trainer scores a batch with ``reward_fn(batch, return_dict=True)`` and logs the result's ``metrics``
(``reward/stage1_calls``, ``reward/stage2_calls``, ``reward/stage2_fraction``). ``reward_model.two_stage``
builds one from the config (the rule/custom scorer ranks, the reward model re-scores the best); pass your
own as ``PPOTrainer(config, reward_fn=TwoStageRewardFn(TwoStageReward(cheap, expensive, top_k_ratio=0.3)))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridflow.dataflow import TwoStageReward, sequence_to_token_scores
from hybridflow.protocol import DataProto

__all__ = ["TwoStageRewardFn", "sequence_scores"]

TokenScorer = Callable[[DataProto], torch.Tensor]


def sequence_scores(token_scorer: TokenScorer) -> Callable[[DataProto], torch.Tensor]:
    """A token-level scorer (``DataProto -> (bs, L)``, like ``RewardManager``) as a sequence scorer
    ``DataProto -> (bs,)`` float32: each row's sum, i.e. the score it placed on the last token."""
    return lambda data: token_scorer(data).sum(-1).float()


class TwoStageRewardFn:
    """Calls ``two_stage`` (sequence scores ``(bs,)``) and places each score on its row's last response
    token, as ``token_level_scores`` ``(bs, L)``. ``reward_extra_info`` gets each row's ``stage1_score``
    and ``stage2_selected`` (whether the expensive scorer saw it)."""

    def __init__(self, two_stage: TwoStageReward) -> None:
        self.two_stage = two_stage

    @classmethod
    def from_config(cls, config: Any, cheap: TokenScorer, expensive: TokenScorer) -> TwoStageRewardFn:
        """From a ``reward_model.two_stage`` section and two token-level scorers (summed per row)."""
        return cls(
            TwoStageReward(
                sequence_scores(cheap),
                sequence_scores(expensive),
                top_k_ratio=config.top_k_ratio,
                threshold=config.threshold,
                unselected=config.unselected,
                unselected_scale=config.unselected_scale,
            )
        )

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        scores, info = self.two_stage(data)
        token_scores = sequence_to_token_scores(scores.float(), data.tensors["response_mask"])
        if not return_dict:
            return token_scores
        extra = {
            "stage1_score": info["stage1_scores"].tolist(),
            "stage2_selected": info["stage2_selected"].tolist(),
        }
        return {"reward_tensor": token_scores, "reward_extra_info": extra, "metrics": info["metrics"]}
