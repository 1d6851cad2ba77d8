"""``validation_metrics`` on hand-made generations: mean@n, acc, pass@n per data source."""

import pytest
import torch

from hybridflow import DataProto
from hybridflow.trainer.metrics import validation_metrics


def generated(sources: list[str], uids: list[str], scores: list[float]) -> tuple[DataProto, torch.Tensor]:
    """A generated batch of 3-token responses whose score sits on the last token, as RewardManager puts it."""
    reward = torch.zeros(len(scores), 3)
    reward[:, -1] = torch.tensor(scores)
    batch = DataProto.from_dict(
        {"responses": torch.zeros(len(scores), 3, dtype=torch.long)}, {"data_source": sources, "uid": uids}
    )
    return batch, reward


def test_pass_at_n_counts_prompts_with_any_correct_sample():
    # arithmetic reports acc; score 0.5 is a well-formed wrong answer (acc 0). Prompt p0: one of two right,
    # p1: none, p2 (split over two batches, as a smaller val_batch_size does): right in its second batch.
    b1, r1 = generated(["arith"] * 4, ["p0", "p0", "p1", "p1"], [1.0, 0.5, 0.5, 0.0])
    b2, r2 = generated(["arith"] * 2, ["p2", "p2"], [0.0, 1.0])
    rows = [
        (b1, {"reward_tensor": r1, "reward_extra_info": {"acc": [1.0, 0.0, 0.0, 0.0]}}),
        (b2, {"reward_tensor": r2, "reward_extra_info": {"acc": [0.0, 1.0]}}),
    ]
    assert validation_metrics(rows, 2) == pytest.approx(
        {
            "val/arith/reward/mean@2": 3.0 / 6,  # (1 + 0.5 + 0.5 + 0 + 0 + 1) / 6
            "val/arith/acc/mean@2": 2.0 / 6,
            "val/arith/pass@2": 2.0 / 3,  # p0 and p2
        }
    )


def test_sources_without_acc_count_positive_scores_in_a_mixed_batch():
    # One batch mixing a scorer with acc (arith) and one returning a float (gsm8k): RewardManager gives the
    # gsm8k rows acc None, and those are judged by score > 0.
    batch, reward = generated(
        ["arith", "arith", "gsm8k", "gsm8k", "gsm8k", "gsm8k"],
        ["a", "a", "g0", "g0", "g1", "g1"],
        [0.5, 0.0, 0.0, 1.0, 0.0, -1.0],
    )
    rows = [
        (batch, {"reward_tensor": reward, "reward_extra_info": {"acc": [0.0, 0.0, None, None, None, None]}})
    ]
    assert validation_metrics(rows, 2) == pytest.approx(
        {
            "val/arith/reward/mean@2": 0.25,
            "val/arith/acc/mean@2": 0.0,
            "val/arith/pass@2": 0.0,
            "val/gsm8k/reward/mean@2": 0.0,
            "val/gsm8k/pass@2": 0.5,  # g0 has a positive sample, g1 none
        }
    )


def test_without_extra_info_pass_at_one_is_the_positive_rate():
    batch, reward = generated(["s"] * 4, ["a", "b", "c", "d"], [1.0, 0.0, 0.2, -0.3])
    assert validation_metrics([(batch, {"reward_tensor": reward})], 1) == pytest.approx(
        {"val/s/reward/mean@1": 0.225, "val/s/pass@1": 0.5}
    )
