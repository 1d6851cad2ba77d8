"""TwoStageReward: selection per group, call counts, final scores; sequence_to_token_scores."""

import numpy as np
import pytest
import torch

from hybridflow import DataProto
from hybridflow.dataflow import TwoStageReward, sequence_to_token_scores, top_k_per_group


class CountingScorer:
    """A real scorer (``10 * quality``) that records how many rows each call scored."""

    def __init__(self):
        self.calls = []

    def __call__(self, data):
        self.calls.append(len(data))
        return data.batch["quality"] * 10


def cheap(data):
    return data.batch["cheap"]


def batch(cheap_scores, uids):
    cheap_scores = torch.tensor(cheap_scores, dtype=torch.float32)
    return DataProto.from_dict(
        tensors={"cheap": cheap_scores, "quality": torch.arange(len(cheap_scores)) / 100},
        non_tensors={"uid": uids},
    )


def test_top_30_percent_of_groups_of_ten_cuts_expensive_rows_by_70_percent():
    rng = np.random.default_rng(0)
    uids = rng.permutation(np.repeat([f"p{g}" for g in range(8)], 10))  # 8 groups of 10, interleaved
    data = batch(rng.random(80), list(uids))
    expensive = CountingScorer()
    scores, info = TwoStageReward(cheap, expensive, top_k_ratio=0.3)(data)

    assert expensive.calls == [24]  # one call, 3 rows per group
    assert sum(expensive.calls) <= 0.3 * 80  # at least 70 % fewer rows than scoring everything
    assert info["metrics"] == {
        "reward/stage1_calls": 80,
        "reward/stage2_calls": 24,
        "reward/stage2_fraction": 0.3,
    }
    selected = info["stage2_selected"]
    assert selected.dtype == bool and selected.sum() == 24
    for g in range(8):  # exactly the three best cheap scores of every group
        rows = np.flatnonzero(uids == f"p{g}")
        best = rows[np.argsort(-data.batch["cheap"].numpy()[rows])[:3]]
        assert set(rows[selected[rows]]) == set(best)
    torch.testing.assert_close(scores[selected], data.batch["quality"][selected] * 10)
    torch.testing.assert_close(scores[~selected], data.batch["cheap"][~selected])
    torch.testing.assert_close(info["stage1_scores"], data.batch["cheap"])


def test_small_groups_hand_checked():
    # group a: cheap [0.1, 0.9, 0.5, 0.9, 0.2]; group b: [0.3, 0.8, 0.6].
    data = batch([0.1, 0.9, 0.3, 0.5, 0.8, 0.9, 0.2, 0.6], ["a", "a", "b", "a", "b", "a", "a", "b"])
    select = TwoStageReward(cheap, CountingScorer(), top_k_ratio=0.4).select
    # ceil(0.4 * 5) = 2 of a: the two 0.9s (rows 1, 5); ceil(0.4 * 3) = 2 of b: 0.8 and 0.6 (rows 4, 7).
    assert np.flatnonzero(select(data, data.batch["cheap"])).tolist() == [1, 4, 5, 7]
    # ceil(0.2 * 5) = 1 of a: the tie at 0.9 goes to the earlier row 1; ceil(0.2 * 3) = 1 of b: row 4.
    select = TwoStageReward(cheap, CountingScorer(), top_k_ratio=0.2).select
    assert np.flatnonzero(select(data, data.batch["cheap"])).tolist() == [1, 4]
    # group_key=None ranks the whole batch: ceil(0.2 * 8) = 2 -> rows 1 and 5.
    select = TwoStageReward(cheap, CountingScorer(), top_k_ratio=0.2, group_key=None).select
    assert np.flatnonzero(select(data, data.batch["cheap"])).tolist() == [1, 5]


def test_ratio_rounding_is_exact():
    # 0.07 * 100 is 7.000000000000001 in floating point; a naive ceil would select 8.
    assert top_k_per_group(np.arange(100.0), np.zeros(100, dtype=np.int64), 0.07).sum() == 7
    assert np.flatnonzero(
        top_k_per_group(np.arange(100.0), np.zeros(100, dtype=np.int64), 0.07)
    ).tolist() == list(range(93, 100))


def test_threshold_mode_selects_scores_strictly_above():
    data = batch([0.2, 0.5, 0.7, 0.9], ["a", "a", "a", "b"])
    expensive = CountingScorer()
    scores, info = TwoStageReward(cheap, expensive, threshold=0.5)(data)
    assert info["stage2_selected"].tolist() == [False, False, True, True]
    assert expensive.calls == [2]
    torch.testing.assert_close(scores, torch.tensor([0.2, 0.5, 0.2, 0.3]))  # quality = row / 100, times 10

    expensive = CountingScorer()
    scores, info = TwoStageReward(cheap, expensive, threshold=0.95)(data)
    assert expensive.calls == [] and info["metrics"]["reward/stage2_calls"] == 0
    torch.testing.assert_close(scores, data.batch["cheap"])


@pytest.mark.parametrize(
    "mode, scale, expected",
    [
        ("keep", 1.0, [0.2, 0.5, 0.2, 0.3]),
        ("scale", 0.5, [0.1, 0.25, 0.2, 0.3]),
        ("zero", 1.0, [0.0, 0.0, 0.2, 0.3]),
    ],
)
def test_unselected_modes(mode, scale, expected):
    data = batch([0.2, 0.5, 0.7, 0.9], ["a", "a", "a", "b"])
    scores, _ = TwoStageReward(
        cheap, CountingScorer(), threshold=0.6, unselected=mode, unselected_scale=scale
    )(data)
    torch.testing.assert_close(scores, torch.tensor(expected))


def test_errors_name_the_culprit():
    data = batch([0.2, 0.5], ["a", "a"])
    with pytest.raises(
        ValueError,
        match=r"cheap_fn must return a float tensor of shape \(2,\), got torch.float32 "
        r"tensor of shape \(2, 1\)",
    ):
        TwoStageReward(lambda d: d.batch["cheap"][:, None], CountingScorer())(data)
    with pytest.raises(ValueError, match=r"expensive_fn must return .* shape \(1,\), got list"):
        TwoStageReward(cheap, lambda d: [1.0], top_k_ratio=0.5)(data)
    with pytest.raises(KeyError, match=r"no group column 'prompt_id'.*available: \['uid'\]"):
        TwoStageReward(cheap, CountingScorer(), group_key="prompt_id")(data)
    with pytest.raises(ValueError, match="top_k_ratio must be in"):
        TwoStageReward(cheap, CountingScorer(), top_k_ratio=0.0)
    with pytest.raises(ValueError, match="unknown unselected mode 'drop'"):
        TwoStageReward(cheap, CountingScorer(), unselected="drop")


def test_sequence_to_token_scores_puts_the_score_on_the_last_response_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 1], [1, 1, 1, 1]])
    out = sequence_to_token_scores(torch.tensor([1.0, -2.0, 3.0, 0.5]), mask)
    torch.testing.assert_close(
        out,
        torch.tensor(
            [[0.0, 0.0, 1.0, 0.0], [-2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.5]]
        ),
    )
    with pytest.raises(ValueError, match=r"rows \[1\] have no response token"):
        sequence_to_token_scores(torch.ones(2), torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match=r"scores \(3,\) do not match response_mask \(2, 4\)"):
        sequence_to_token_scores(torch.ones(3), mask[:2])
