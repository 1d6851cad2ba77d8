"""ReplayBuffer and ScheduledSampler: sampling distributions, weights, eviction, ids, checkpoints."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import DataProto
from hybridflow.config.schema import PPOConfig
from hybridflow.dataflow import ReplayBuffer, ScheduledSampler, importance_weights, priority_probabilities


def rows(values, width=3):
    """Rows whose tensor ``x`` and column ``name`` both identify the row by ``values``."""
    values = list(values)
    return DataProto.from_dict(
        tensors={
            "x": torch.tensor(values, dtype=torch.float32),
            "tokens": torch.tensor(values).repeat_interleave(width).view(-1, width),
        },
        non_tensors={"name": [f"r{v}" for v in values]},
        meta_info={"temperature": 0.7, "metrics": {"step_reward": 0.5}},
    )


def stored_values(buf):
    data, _, _ = buf.sample(len(buf), replace=False)
    return sorted(data.batch["x"].int().tolist())


def test_priority_sampling_frequencies_match_p_alpha():
    priorities = np.array([0.5, 1.0, 2.0, 4.0, 8.0])
    buf = ReplayBuffer(capacity=10, seed=0)
    buf.push(rows(range(5)), priorities=priorities)
    draws = 200_000
    _, ids, _ = buf.sample(draws, strategy="priority", alpha=0.6)
    counts = np.bincount(ids, minlength=5)

    def within_4_sigma(alpha):
        p = priorities**alpha / (priorities**alpha).sum()
        return np.abs(counts - draws * p) <= 4 * np.sqrt(draws * p * (1 - p))

    assert within_4_sigma(0.6).all(), counts
    # The bound is tight enough to tell alpha = 0.6 from alpha = 0.5 or proportional sampling.
    assert not within_4_sigma(0.5).all()
    assert not within_4_sigma(1.0).all()


def test_importance_weights_hand_checked_on_three_rows():
    # p = [1, 2, 3], alpha = 1: P = [1/6, 2/6, 3/6], N * P = [0.5, 1, 1.5];
    # w = (N * P)^-0.5 = [1.4142, 1, 0.8165]; divided by the largest: [1, 0.7071, 0.5774].
    probs = priority_probabilities(np.array([1.0, 2.0, 3.0]), alpha=1.0)
    np.testing.assert_allclose(probs, [1 / 6, 2 / 6, 3 / 6])
    np.testing.assert_allclose(
        importance_weights(probs, np.array([2, 0, 1, 2]), beta=0.5),
        [1 / math.sqrt(3), 1.0, 1 / math.sqrt(2), 1 / math.sqrt(3)],
    )

    buf = ReplayBuffer(capacity=3, seed=1)
    buf.push(rows([10, 11, 12]), priorities=[1.0, 2.0, 3.0])
    data, ids, weights = buf.sample(50, strategy="priority", alpha=1.0, beta=0.5)
    expected = np.array([1.0, 1 / math.sqrt(2), 1 / math.sqrt(3)])[ids]
    np.testing.assert_allclose(weights, expected)
    assert data.batch["is_weights"].dtype == torch.float32
    np.testing.assert_allclose(data.batch["is_weights"].numpy(), expected, rtol=1e-6)
    # The rows returned are the rows with those ids.
    assert data.batch["x"].int().tolist() == (ids + 10).tolist()
    assert list(data.non_tensor_batch["name"]) == [f"r{i + 10}" for i in ids]


def test_uniform_weights_are_one_and_zero_priority_rows_are_never_drawn():
    buf = ReplayBuffer(capacity=4, seed=2)
    buf.push(rows(range(4)), priorities=[0.0, 1.0, 0.0, 1.0])
    _, ids, weights = buf.sample(200, strategy="priority", alpha=0.6, beta=1.0)
    assert set(ids.tolist()) == {1, 3}
    np.testing.assert_allclose(weights, 1.0)  # equal priorities among drawable rows
    data, _, weights = buf.sample(20)
    assert weights.tolist() == [1.0] * 20 and data.batch["is_weights"].tolist() == [1.0] * 20
    with pytest.raises(ValueError, match="only 2 of 4 rows have a priority above zero"):
        buf.sample(3, strategy="priority", replace=False)
    with pytest.raises(ValueError, match="unknown sampling strategy 'greedy'"):
        buf.sample(1, strategy="greedy")


def test_fifo_eviction_keeps_the_newest_rows_and_their_priorities():
    buf = ReplayBuffer(capacity=5, seed=0)
    assert buf.push(rows([0, 1, 2]), priorities=[1.0, 2.0, 3.0]).tolist() == [0, 1, 2]
    assert buf.push(rows([3, 4, 5, 6]), priorities=[4.0, 5.0, 6.0, 7.0]).tolist() == [3, 4, 5, 6]
    assert len(buf) == 5 and buf.oldest_id == 2
    assert stored_values(buf) == [2, 3, 4, 5, 6]
    assert buf.priorities.tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
    # One push larger than the whole buffer keeps only its newest rows.
    buf.push(rows(range(10, 17)), priorities=np.arange(10.0, 17.0))
    assert stored_values(buf) == [12, 13, 14, 15, 16] and buf.oldest_id == 9  # ids 7..13 pushed
    assert buf.priorities.tolist() == [12.0, 13.0, 14.0, 15.0, 16.0]


def test_new_rows_get_the_current_max_priority():
    buf = ReplayBuffer(capacity=10)
    buf.push(rows([0]))
    assert buf.priorities.tolist() == [1.0]
    buf.push(rows([1, 2]), priorities=[0.5, 4.0])
    buf.push(rows([3]))
    buf.push(rows([4, 5]), priorities=2.5)
    assert buf.priorities.tolist() == [1.0, 0.5, 4.0, 4.0, 2.5, 2.5]
    zeros = ReplayBuffer(capacity=10)
    zeros.push(rows([0]), priorities=0.0)
    zeros.push(rows([1]))  # a zero maximum would make the new row undrawable
    assert zeros.priorities.tolist() == [0.0, 1.0]


def test_update_priorities_by_id_skips_evicted_rows():
    buf = ReplayBuffer(capacity=3, seed=0)
    buf.push(rows([0, 1, 2]))
    buf.push(rows([3]))  # evicts id 0
    assert buf.update_priorities([0, 1, 3, 3], [9.0, 2.0, 5.0, 6.0]) == 1
    assert buf.priorities.tolist() == [2.0, 1.0, 6.0]  # ids 1, 2, 3; the repeated id 3 takes its last value
    assert buf.update_priorities(np.array([2]), 0.25) == 0
    assert buf.priorities.tolist() == [2.0, 0.25, 6.0]
    with pytest.raises(ValueError, match=r"ids \[4\] were never handed out"):
        buf.update_priorities([1, 4], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"finite and >= 0; bad at positions \[1\]"):
        buf.update_priorities([1, 2], [1.0, -1.0])
    with pytest.raises(ValueError, match=r"2 rows"):
        buf.update_priorities([1, 2], [1.0, 2.0, 3.0])


def test_same_seed_same_samples():
    def run(seed):
        buf = ReplayBuffer(capacity=6, seed=seed)
        drawn = []
        for step in range(4):
            buf.push(rows(range(step * 3, step * 3 + 3)), priorities=np.arange(1.0, 4.0))
            data, ids, _ = buf.sample(5, strategy="priority" if step % 2 else "uniform")
            drawn.append((ids.tolist(), data.batch["x"].tolist()))
        return drawn

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_push_with_other_keys_or_shapes_is_an_error_naming_them():
    buf = ReplayBuffer(capacity=10)
    buf.push(rows([0, 1]))
    other = rows([2])
    other.non_tensor_batch["extra"] = np.array(["?"], dtype=object)
    other.pop(batch_keys=["x"])
    with pytest.raises(ValueError, match=r"missing \['x'\], unexpected \['extra'\]"):
        buf.push(other)
    with pytest.raises(ValueError, match=r"'tokens' has per-row shape \(5,\).*holds \(3,\).*pad every push"):
        buf.push(rows([2], width=5))
    wider = rows([2])
    wider.batch["x"] = wider.batch["x"].double()
    with pytest.raises(ValueError, match="'x' has per-row shape .* torch.float64"):
        buf.push(wider)
    with pytest.raises(ValueError, match=r"priorities of shape \(3,\) for 2 rows"):
        buf.push(rows([5, 6]), priorities=[1.0, 1.0, 1.0])
    assert len(buf) == 2


def test_push_copies_rows_and_sample_keeps_meta_info_without_metrics():
    buf = ReplayBuffer(capacity=4, seed=0)
    batch = rows([7])
    buf.push(batch)
    batch.batch["x"] += 100  # the caller changing its batch later must not change stored rows
    data, _, _ = buf.sample(2)
    assert data.batch["x"].tolist() == [7.0, 7.0]
    assert data.meta_info == {"temperature": 0.7}
    # Rows without tensors still get is_weights as a tensor.
    text_only = ReplayBuffer(capacity=2, seed=0)
    text_only.push(DataProto.from_dict(non_tensors={"prompt": ["a", "b"]}))
    data, _, _ = text_only.sample(3)
    assert data.batch["is_weights"].tolist() == [1.0, 1.0, 1.0] and len(data.non_tensor_batch["prompt"]) == 3
    with pytest.raises(ValueError, match="empty ReplayBuffer"):
        ReplayBuffer(capacity=2).sample(1)


def test_state_dict_round_trip_resumes_identically(tmp_path):
    buf = ReplayBuffer(capacity=5, seed=11)
    buf.push(rows([0, 1, 2]), priorities=[1.0, 2.0, 3.0])
    buf.push(rows([3, 4, 5]), priorities=[4.0, 5.0, 6.0])
    buf.sample(4, strategy="priority")
    torch.save(buf.state_dict(), tmp_path / "buffer.pt")

    restored = ReplayBuffer(capacity=5, seed=999)
    restored.load_state_dict(torch.load(tmp_path / "buffer.pt", weights_only=False))
    assert len(restored) == 5 and restored.oldest_id == 1
    assert restored.priorities.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]
    for strategy in ("priority", "uniform"):
        a, ids_a, w_a = buf.sample(6, strategy=strategy)
        b, ids_b, w_b = restored.sample(6, strategy=strategy)
        assert ids_a.tolist() == ids_b.tolist() and w_a.tolist() == w_b.tolist()
        assert torch.equal(a.batch["tokens"], b.batch["tokens"])
        assert a.meta_info == b.meta_info == {"temperature": 0.7}
    assert restored.push(rows([6])).tolist() == [6]

    smaller = ReplayBuffer(capacity=2)
    smaller.load_state_dict(buf.state_dict())
    assert stored_values(smaller) == [4, 5] and smaller.oldest_id == 4


SCHEDULE = [
    {"until_step": 1000, "strategy": "uniform"},
    {"until_step": 5000, "strategy": "priority", "alpha": 0.6},
    {"strategy": "priority", "alpha": 0.8},
]


def test_schedule_switches_at_step_boundaries():
    sampler = ScheduledSampler(SCHEDULE, beta=0.5)
    assert sampler.params(0) == {"strategy": "uniform", "alpha": 0.6, "beta": 0.5}
    assert sampler.params(999)["strategy"] == "uniform"
    assert sampler.params(1000) == {"strategy": "priority", "alpha": 0.6, "beta": 0.5}
    assert sampler.params(4999)["alpha"] == 0.6
    assert sampler.params(5000) == {"strategy": "priority", "alpha": 0.8, "beta": 0.5}
    assert sampler.params(10**9)["alpha"] == 0.8

    buf = ReplayBuffer(capacity=3, seed=0)
    buf.push(rows([0, 1, 2]), priorities=[1.0, 2.0, 3.0])
    _, _, weights = sampler.sample(buf, 30, step=999)
    assert set(weights.tolist()) == {1.0}
    _, ids, weights = sampler.sample(buf, 30, step=1000)
    expected = importance_weights(priority_probabilities(np.array([1.0, 2.0, 3.0]), 0.6), ids, 0.5)
    np.testing.assert_allclose(weights, expected)
    assert weights.min() < 1.0


def test_schedule_from_config_and_its_errors():
    @dataclasses.dataclass
    class Cfg:
        capacity: int = 100
        strategy: str = "priority"
        alpha: float = 0.7
        beta: float = 0.3
        schedule: list | None = None

    constant = ScheduledSampler.from_config(Cfg())
    assert constant.params(0) == constant.params(10**6) == {"strategy": "priority", "alpha": 0.7, "beta": 0.3}
    typed = PPOConfig.from_dict({"replay_buffer": {"capacity": 10, "alpha": 0.9, "schedule": SCHEDULE[:2]}})
    scheduled = ScheduledSampler.from_config(typed.replay_buffer)
    assert scheduled.params(0) == {"strategy": "uniform", "alpha": 0.9, "beta": 0.4}
    assert scheduled.params(2000)["alpha"] == 0.6
    from_yaml = ScheduledSampler.from_config(
        OmegaConf.create({"strategy": "uniform", "alpha": 0.6, "beta": 0.4, "schedule": SCHEDULE})
    )
    assert from_yaml.params(999) == {"strategy": "uniform", "alpha": 0.6, "beta": 0.4}
    assert from_yaml.params(5000) == {"strategy": "priority", "alpha": 0.8, "beta": 0.4}

    with pytest.raises(ValueError, match="last schedule phase .* must omit until_step"):
        ScheduledSampler([{"until_step": 10}])
    with pytest.raises(ValueError, match="phase 0 needs until_step"):
        ScheduledSampler([{}, {}])
    with pytest.raises(ValueError, match=r"until_step values must increase, got \[10, 10\]"):
        ScheduledSampler([{"until_step": 10}, {"until_step": 10}, {}])
    with pytest.raises(ValueError, match=r"phase 1 has unknown keys \['alhpa'\]"):
        ScheduledSampler([{"until_step": 10}, {"alhpa": 0.5}])
    with pytest.raises(ValueError, match="phase 0: unknown strategy 'rank'"):
        ScheduledSampler([{"strategy": "rank"}])
