"""The trainer's replay (fixed-width rows, weighted replay, priorities) and its config-driven two-stage reward."""

from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow import DataProto
from hybridflow.config.schema import PPOConfig
from hybridflow.data.prepare import main as prepare_data
from hybridflow.dataflow import ScheduledSampler
from hybridflow.trainer import PPOTrainer, load_config
from hybridflow.trainer.replay import (
    ActorReplay,
    advantage_priorities,
    set_prompt_width,
    surrogate_priorities,
    used_prompt_width,
)
from hybridflow.workers.actor import UPDATE_ACTOR_KEYS

PAD = 9


def rollouts(
    prompt_lengths: list[int], width: int, advantages: list[list[float]], start: int = 1
) -> DataProto:
    """Rows of ``width`` left-padded prompt columns (real lengths ``prompt_lengths``) and 2 response tokens."""
    rows = []
    for i, length in enumerate(prompt_lengths):
        prompt = [PAD] * (width - length) + list(range(start + 10 * i, start + 10 * i + length))
        rows.append((prompt, [0] * (width - length) + [1] * length))
    prompts = torch.tensor([p for p, _ in rows])
    prompt_mask = torch.tensor([m for _, m in rows])
    responses = torch.tensor([[7, 8]] * len(rows))
    mask = torch.ones_like(responses)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": mask,
            "input_ids": torch.cat([prompts, responses], -1),
            "attention_mask": torch.cat([prompt_mask, mask], -1),
            "position_ids": torch.cat([positions, positions[:, -1:] + torch.tensor([1, 2])], -1),
            "advantages": torch.tensor(advantages),
            "old_log_probs": torch.full((len(rows), 2), -1.0),
        },
        {"uid": [f"u{i}" for i in range(len(rows))]},
    )


def test_prompt_width_pads_like_the_dataset_and_trims_back():
    data = rollouts([1, 3], width=3, advantages=[[0.0, 0.0]] * 2)
    assert used_prompt_width(data) == 3
    wide = set_prompt_width(data, 5, PAD)
    assert wide.batch["input_ids"].tolist() == [[PAD, PAD, PAD, PAD, 1, 7, 8], [PAD, PAD, 11, 12, 13, 7, 8]]
    assert wide.batch["prompts"].tolist() == [[PAD, PAD, PAD, PAD, 1], [PAD, PAD, 11, 12, 13]]
    assert wide.batch["attention_mask"].tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]]
    assert wide.batch["position_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 2], [0, 0, 0, 1, 2, 3, 4]]
    assert torch.equal(wide.batch["responses"], data.batch["responses"])
    assert used_prompt_width(wide) == 3
    back = set_prompt_width(wide, 3, PAD)
    for key in ("input_ids", "prompts", "attention_mask", "position_ids"):
        assert torch.equal(back.batch[key], data.batch[key]), key
    # an MoE rollout's chosen experts (bs, P + L, layers, k) move with their tokens, -1 in the new padding
    data.batch["routed_experts"] = torch.arange(2 * 5 * 2 * 1, dtype=torch.int16).view(2, 5, 2, 1)
    routed = set_prompt_width(data, 5, PAD).batch["routed_experts"]
    assert routed.shape == (2, 7, 2, 1) and (routed[:, :2] == -1).all()
    assert torch.equal(routed[:, 2:], data.batch["routed_experts"])
    assert torch.equal(
        set_prompt_width(set_prompt_width(data, 5, PAD), 3, PAD).batch["routed_experts"],
        data.batch["routed_experts"],
    )
    with pytest.raises(
        ValueError, match="cannot fit prompts into 2 columns: the longest prompt of the batch takes 3"
    ):
        set_prompt_width(data, 2, PAD)


def test_priorities_by_hand():
    data = rollouts([1, 1], width=1, advantages=[[2.0, -4.0], [0.0, 0.0]])
    data.batch["response_mask"] = torch.tensor([[1, 1], [1, 0]])
    np.testing.assert_allclose(advantage_priorities(data), [3.0, 0.0])
    # ratios e^0 = 1, e^0.5 = 1.65 (A > 0: past 1 + 0.2, clipped), e^-0.5 = 0.61 (A < 0: past 1 - 0.2, clipped),
    # e^0.1 = 1.105 (A < 0: the clip is on the other side, still a gradient)
    advantages = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    log_ratio = torch.tensor([[0.0, 0.5], [-0.5, 0.1]])
    priorities = surrogate_priorities(advantages, log_ratio, torch.zeros(2, 2), torch.ones(2, 2), 0.2, 0.2)
    np.testing.assert_allclose(priorities, [(1.0 + 0.0) / 2, (0.0 + 2 * np.exp(0.1)) / 2], rtol=1e-6)


class FixedPolicy:
    """Stands in for the actor group after an update: the log-probs of every token moved by ``shift``."""

    def __init__(self, shift: float) -> None:
        self.shift = shift

    def compute_log_prob(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"old_log_probs": data.batch["old_log_probs"] + self.shift})


def replay(**overrides) -> ActorReplay:
    config = PPOConfig().replay_buffer
    config.capacity, config.sample_size, config.strategy = 8, 3, "priority"
    for key, value in overrides.items():
        setattr(config, key, value)
    return ActorReplay(
        config, rows_per_step=2, max_prompt_length=4, pad_token_id=PAD, clip_low=0.2, clip_high=0.2, seed=0
    )


def test_mix_replays_weighted_rows_of_other_widths_and_rescores_them():
    mixer, metrics = replay(alpha=1.0, beta=1.0), {}
    first = rollouts([2, 1], width=2, advantages=[[1.0, 1.0], [3.0, 3.0]])
    out = mixer.mix(first, step=0, metrics=metrics)
    assert len(out) == 2 and metrics["replay/rows"] == 0 and mixer.replayed is None  # nothing stored yet
    assert out.batch["input_ids"].shape == (2, 4)  # trimmed back to the batch's widest prompt
    np.testing.assert_allclose(mixer.buffer.priorities, [1.0, 3.0])

    second = rollouts([3, 3], width=3, advantages=[[0.5, 0.5], [0.5, 0.5]], start=100)
    out = mixer.mix(second, step=1, metrics=metrics)
    replayed, ids = mixer.replayed
    assert metrics["replay/rows"] == 3 and len(out) == 5 and set(ids.tolist()) <= {0, 1}
    assert out.batch["input_ids"].shape == (5, 5)  # 3 prompt columns + 2 response columns
    # P(row 0) = 1/4, P(row 1) = 3/4: weights (N P)^-1 / max = 1 for row 0 and 1/3 for row 1
    weights = np.where(ids == 0, 1.0, 1 / 3)
    expected = replayed.batch["advantages"] * torch.tensor(weights, dtype=torch.float32)[:, None]
    torch.testing.assert_close(out.batch["advantages"][2:], expected)
    stored_ids = {0: [PAD, 1, 2, 7, 8], 1: [PAD, PAD, 11, 7, 8]}  # the first batch's rows, 3 prompt columns
    assert out.batch["input_ids"][2:].tolist() == [stored_ids[i] for i in ids.tolist()]
    assert out.batch["old_log_probs"][2:].tolist() == [[-1.0, -1.0]] * 3  # the generating policy's
    np.testing.assert_allclose(mixer.buffer.priorities, [1.0, 3.0, 0.5, 0.5])

    mixer.update_priorities(FixedPolicy(shift=0.1), metrics)  # ratio e^0.1 = 1.105: inside the clip range
    stored = {0: 1.0, 1: 3.0}
    for rid in set(ids.tolist()):
        assert mixer.buffer.priorities[rid] == pytest.approx(stored[rid] * np.exp(0.1), rel=1e-6)
    assert mixer.replayed is None


def test_replay_keeps_exactly_the_columns_the_actor_update_reads():
    """The update's input columns are listed once (``UPDATE_ACTOR_KEYS``, in the actor worker), and replay keeps
    those of them a batch has, plus its prompts: a column the update does not read is not stored."""
    batch = rollouts([2, 1], width=2, advantages=[[1.0, 1.0], [3.0, 3.0]])
    batch.batch["values"] = torch.zeros(2, 2)  # the critic's, which the actor update never reads
    batch.batch["ref_log_prob"] = torch.full((2, 2), -2.0)
    out = replay().mix(batch, step=0, metrics={})
    # the rows carry no engine log-probs, no teacher's and no expert routing (a dense model's)
    assert set(out.batch.keys()) == {"prompts", *UPDATE_ACTOR_KEYS} - {
        "rollout_log_probs",
        "teacher_log_prob",
        "routed_experts",
    }


def test_replay_logs_the_alpha_in_force():
    """A uniform phase samples as alpha 0; it used to log the top-level alpha of a later priority phase."""
    schedule = PPOConfig.from_dict(
        {"replay_buffer": {"schedule": [{"until_step": 1, "strategy": "uniform"}]}}
    )
    mixer = replay(alpha=0.8, schedule=schedule.replay_buffer.schedule)
    logged = []
    for step in range(3):
        metrics = {}
        mixer.mix(rollouts([1, 1], width=1, advantages=[[1.0, 1.0]] * 2), step=step, metrics=metrics)
        logged.append((metrics["replay/prioritized"], metrics["replay/alpha"]))
    assert logged == [(0.0, 0.0), (1.0, 0.8), (1.0, 0.8)]


def test_priority_replay_waits_for_a_row_with_signal():
    mixer, metrics = replay(), {}
    mixer.mix(rollouts([1, 1], width=1, advantages=[[0.0, 0.0]] * 2), step=0, metrics=metrics)
    out = mixer.mix(rollouts([1, 1], width=1, advantages=[[0.0, 0.0]] * 2), step=1, metrics=metrics)
    assert len(out) == 2 and metrics["replay/rows"] == 0  # all priorities 0: nothing worth replaying
    with pytest.raises(KeyError, match="old_log_probs"):
        mixer.mix(
            rollouts([1], width=1, advantages=[[1.0, 1.0]]).select(
                batch_keys=[
                    "prompts",
                    "responses",
                    "response_mask",
                    "input_ids",
                    "attention_mask",
                    "position_ids",
                    "advantages",
                ]
            ),
            step=2,
            metrics=metrics,
        )
    with pytest.raises(ValueError, match=r"sample_size \(3\) must be a multiple of trainer.n_workers \(2\)"):
        ActorReplay(
            PPOConfig().replay_buffer,
            rows_per_step=3,
            max_prompt_length=4,
            pad_token_id=PAD,
            clip_low=0.2,
            clip_high=0.2,
            n_workers=2,
        )


def test_config_schedule_ends_with_the_top_level_strategy():
    config = load_config(
        [
            "data.train_files=x.parquet",
            "replay_buffer.strategy=priority",
            "replay_buffer.alpha=0.8",
            "replay_buffer.schedule=[{until_step: 2, strategy: uniform}, "
            "{until_step: 4, strategy: priority, alpha: 0.4}]",
        ]
    )
    sampler = ScheduledSampler.from_config(config.replay_buffer)
    assert [sampler.params(s)["strategy"] for s in (0, 1, 2, 5)] == [
        "uniform",
        "uniform",
        "priority",
        "priority",
    ]
    assert [sampler.params(s)["alpha"] for s in (1, 3, 4, 100)] == [0.8, 0.4, 0.8, 0.8]


@pytest.fixture
def one_thread():
    """A tiny model gains nothing from threads; on a shared CPU two threads ran 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_config_two_stage_reward_sends_the_best_half_to_the_reward_model(
    tiny_model_path, tmp_path: Path, one_thread
):
    prepare_data(
        ["arithmetic", str(tmp_path / "data"), "--train-size", "8", "--test-size", "1", "--seed", "0"]
    )
    config = load_config(
        [
            f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
            f"actor_rollout_ref.model.path={tiny_model_path}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "data.max_prompt_length=64",
            "data.max_response_length=4",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.total_training_steps=1",
            "trainer.logger=[file]",
            "trainer.val_before_train=false",
            "reward_model.enable=true",
            "reward_model.dummy=true",
            "reward_model.two_stage.enable=true",
            "reward_model.two_stage.top_k_ratio=0.5",
            "reward_model.two_stage.unselected=zero",
        ]
    )
    trainer = PPOTrainer(config)
    scored = []
    trainer.register_hook("after_reward", lambda trainer, step, metrics, batch: scored.append(batch))
    metrics = trainer.fit()
    assert (metrics["reward/stage1_calls"], metrics["reward/stage2_calls"]) == (8, 4)
    assert metrics["reward/stage2_fraction"] == 0.5
    batch = scored[0]
    selected = batch.non_tensor_batch["reward_extra/stage2_selected"].astype(bool)
    # The random model never answers right: cheap scores tie at 0, so each pair's first sample is judged
    assert selected.tolist() == [True, False] * 4
    final = batch.batch["token_level_scores"].sum(-1)
    judged = (batch.batch["response_mask"].sum(-1) / 4).clamp(max=1.0)  # the dummy reward model: length / 4
    torch.testing.assert_close(final[selected], judged[selected].float())
    assert final[~selected].abs().sum() == 0


def test_replay_buffer_survives_a_resume(tiny_model_path, tmp_path: Path, one_thread):
    prepare_data(
        ["arithmetic", str(tmp_path / "data"), "--train-size", "16", "--test-size", "1", "--seed", "0"]
    )

    def config(steps: int) -> PPOConfig:
        return load_config(
            [
                f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
                f"actor_rollout_ref.model.path={tiny_model_path}",
                f"trainer.default_local_dir={tmp_path / 'run'}",
                "data.max_prompt_length=64",
                "data.max_response_length=4",
                "data.train_batch_size=4",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                f"trainer.total_training_steps={steps}",
                "trainer.logger=[file]",
                "trainer.val_before_train=false",
                "algorithm.adv_estimator=grpo",
                "replay_buffer.enable=true",
                "replay_buffer.sample_size=4",
            ]
        )

    with PPOTrainer(config(2)) as first:
        first.fit()
        stored = len(first.replay.buffer)
    assert stored == 16  # two steps of 4 prompts x 2 samples
    with PPOTrainer(config(3)) as resumed:
        resumed.init_workers()
        resumed.load_checkpoint()
        assert resumed.global_step == 2 and len(resumed.replay.buffer) == stored
