"""Dynamic sampling (``algorithm.filter_groups``): which groups a refill keeps, in which order and how many;
on the tiny model in sync and asynchronous runs, with the agent loop and a served agent; and a resume after a
refilled batch trains exactly what an uninterrupted run trains."""

import json
from pathlib import Path

import pytest
import torch
from tiny_runs import reward_written, run_settings

from hybridflow import DataProto
from hybridflow.config.schema import ConfigError
from hybridflow.trainer import PPOTrainer, load_config
from hybridflow.trainer.dynamic_sampling import GroupFilter
from hybridflow.utils.errors import UserError

# the tiny model's random replies have an even or odd number of characters about as often: with 2 samples a
# group, about half the groups are all-0 or all-1 (filtered) and half vary
PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str) % 2), "odd": float(len(solution_str) % 2)}
"""
TIMED = ("timing_s/", "perf/", "async/")


# ------------------------------------------------------------------------------- the refill, by hand
def prompts(ids: list[int], width: int) -> DataProto:
    """Prompts ``ids`` left-padded to ``width`` columns (a real prompt of 2 tokens each)."""
    tokens = torch.zeros(len(ids), width, dtype=torch.long)
    tokens[:, -2:] = torch.tensor(ids)[:, None]
    mask = torch.zeros_like(tokens)
    mask[:, -2:] = 1
    return DataProto.from_dict(
        {"input_ids": tokens, "attention_mask": mask, "position_ids": mask.cumsum(-1)},
        {"uid": [f"u{i}" for i in ids], "pid": ids},
    )


def generate(batch: DataProto) -> DataProto:
    """Two samples per prompt, responses of 3 tokens (the prompt id, then 1, 2)."""
    rows = batch.repeat(2, interleave=True)
    responses = torch.tensor([[pid, 1, 2] for pid in rows.non_tensor_batch["pid"]])
    mask = torch.ones_like(responses)
    rows.batch["prompts"] = rows.batch["input_ids"]
    rows.batch["responses"], rows.batch["response_mask"] = responses, mask
    rows.batch["input_ids"] = torch.cat([rows.batch["input_ids"], responses], dim=1)
    rows.batch["attention_mask"] = torch.cat([rows.batch["attention_mask"], mask], dim=1)
    rows.batch["position_ids"] = torch.cat([rows.batch["position_ids"], 2 + mask.cumsum(-1)], dim=1)
    return rows


# each prompt's two rewards: 0, 2 and 5 score alike (filtered), 1, 3, 4 and 6 vary
REWARDS = {0: (1, 1), 1: (0, 1), 2: (0, 0), 3: (1, 0), 4: (1, 0), 5: (0, 0), 6: (0, 1)}


def score(batch: DataProto, metrics: dict) -> DataProto:
    """Row ``2i + j`` (sample ``j`` of prompt ``i``) scores ``REWARDS[pid][j]`` on its last token."""
    values = [REWARDS[pid][row % 2] for row, pid in enumerate(batch.non_tensor_batch["pid"])]
    scores = torch.zeros(len(batch), 3)
    scores[:, -1] = torch.tensor(values, dtype=torch.float32)
    batch.batch["token_level_scores"] = scores
    metrics["reward/calls"] = metrics.get("reward/calls", 0) + 1
    return batch


def refill(groups: int, cap: int, metric: str = "seq_reward") -> GroupFilter:
    config = type("FilterGroups", (), {"metric": metric, "max_num_gen_batches": cap})()
    return GroupFilter(config, groups, pad_token_id=0, score=score)


def test_a_refill_keeps_the_varying_groups_in_order_trimmed_to_the_batch_size():
    more = iter([prompts([2, 3], width=5), prompts([4, 6, 5], width=3)])
    batch = refill(groups=3, cap=0).fill(prompts([0, 1], width=4), generate, lambda: next(more))
    # batch 1 keeps prompt 1, batch 2 prompt 3, batch 3 prompts 4 and 6: 4 >= 3, and 6 is the surplus
    assert list(batch.non_tensor_batch["pid"]) == [1, 1, 3, 3, 4, 4]
    assert batch.batch["token_level_scores"].sum(-1).tolist() == [0, 1, 1, 0, 1, 0]
    # every prompt padded to the widest real prompt (2 tokens), responses unchanged
    assert batch.batch["prompts"].shape == (6, 2) and batch.batch["input_ids"][:, -3:].tolist()[0] == [
        1,
        1,
        2,
    ]
    metrics = batch.meta_info["metrics"]
    assert metrics["dynamic_sampling/gen_batches"] == 3.0
    assert metrics["dynamic_sampling/samples_generated"] == 14.0
    assert metrics["dynamic_sampling/kept_group_frac"] == pytest.approx(4 / 7)
    assert metrics["dynamic_sampling/filtered_group_frac"] == pytest.approx(3 / 7)
    assert metrics["dynamic_sampling/samples_per_trained_sample"] == pytest.approx(14 / 6)
    assert metrics["dynamic_sampling/full_batch"] == 1.0 and metrics["reward/calls"] == 3


def test_at_the_cap_the_step_trains_on_what_it_has(caplog):
    more = iter([prompts([2, 3], width=5), prompts([4, 6], width=3)])
    batch = refill(groups=3, cap=2).fill(prompts([0, 1], width=4), generate, lambda: next(more))
    assert list(batch.non_tensor_batch["pid"]) == [1, 1, 3, 3]
    assert batch.meta_info["metrics"]["dynamic_sampling/full_batch"] == 0.0
    assert "2 of 3 groups varied in 2 generation batches" in caplog.text
    # nothing varied: the last generation batch, as it is (its advantages are zero)
    batch = refill(groups=1, cap=1).fill(prompts([0, 2], width=4), generate, lambda: None)
    assert list(batch.non_tensor_batch["pid"]) == [0, 0, 2, 2]


def test_a_filter_metric_the_reward_function_does_not_return_is_refused():
    with pytest.raises(UserError, match="metric='acc': the reward function did not return 'acc'"):
        refill(groups=1, cap=1, metric="acc").fill(prompts([1], width=2), generate, lambda: None)


# ------------------------------------------------------------------------------- runs on the tiny model
@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    return reward_written(tmp_path_factory, "parity.py", PARITY_REWARD)


def config(data_dir: Path, model: str, reward: Path, run_dir: Path, *overrides: str):
    return load_config(
        run_settings(
            data_dir,
            model,
            run_dir,
            f"custom_reward_function.path={reward}",
            "data.max_response_length=6",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "algorithm.adv_estimator=grpo",
            "algorithm.filter_groups.enable=true",
            "trainer.total_training_steps=4",
            *overrides,
        )
    )


def prompts_of(batch: DataProto) -> list[str]:
    return list(dict.fromkeys(p[-1]["content"] for p in batch.non_tensor_batch["raw_prompt"]))


def run(cfg, stop_at: int | None = None) -> tuple[list[dict], list[list[str]], dict[str, torch.Tensor]]:
    """Each logged step, the prompts each step trained, and the final weights; ``stop_at``: the run stops
    (a hook raises) right after the checkpoint of that step."""
    trained = []

    def stop(trainer, step, metrics, batch):
        if step == stop_at:
            raise KeyboardInterrupt

    with PPOTrainer(cfg) as trainer:
        trainer.register_hook("on_step_end", lambda t, step, m, batch: trained.append(prompts_of(batch)))
        trainer.register_hook("on_checkpoint", stop)
        try:
            trainer.fit()
        except KeyboardInterrupt:
            pass
        weights = {
            k: torch.from_numpy(v.copy()) for k, v in trainer.wg.actor_rollout.get_weights()[0].items()
        }
    rows = Path(cfg.trainer.default_local_dir, "metrics.jsonl").read_text().splitlines()
    return [json.loads(row) for row in rows], trained, weights


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMED)} for row in rows]


def test_every_trained_group_varies_and_the_batch_is_full(data_dir, tiny_model_path, reward_file, tmp_path):
    batches = []
    cfg = config(data_dir, tiny_model_path, reward_file, tmp_path, "algorithm.filter_groups.metric=odd")
    with PPOTrainer(cfg) as trainer:
        trainer.register_hook("after_reward", lambda t, step, m, batch: batches.append(batch))
        trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(batches) == 4 and all(len(b) == 8 for b in batches)
    for batch in batches:
        scores = batch.batch["token_level_scores"].sum(-1).view(4, 2)  # 4 groups of 2, in order
        assert (scores[:, 0] != scores[:, 1]).all()
    assert all(row["reward/zero_std_group_frac"] == 0.0 for row in rows)
    assert all(row["dynamic_sampling/full_batch"] == 1.0 for row in rows)
    generated = [row["dynamic_sampling/samples_generated"] for row in rows]
    assert generated == [8.0 * row["dynamic_sampling/gen_batches"] for row in rows]
    assert sum(row["dynamic_sampling/gen_batches"] for row in rows) > 4  # some steps needed a refill
    # the checkpoint's data position is after every batch the steps drew, not after one per step
    state = torch.load(tmp_path / "global_step_4" / "trainer_state.pt", weights_only=False)["loader"]
    drawn = int(sum(row["dynamic_sampling/gen_batches"] for row in rows))
    assert state["epoch"] * 16 + state["position"] == drawn  # 64 rows / 4 = 16 batches an epoch


def test_a_resume_after_a_refilled_batch_trains_what_an_uninterrupted_run_trains(
    data_dir, tiny_model_path, reward_file, tmp_path
):
    whole_rows, whole_prompts, whole_weights = run(
        config(data_dir, tiny_model_path, reward_file, tmp_path / "whole", "trainer.save_freq=2")
    )
    assert any(row["dynamic_sampling/gen_batches"] > 1 for row in whole_rows[:2])  # a refill before the save
    cfg = config(data_dir, tiny_model_path, reward_file, tmp_path / "resumed", "trainer.save_freq=2")
    first_rows, first_prompts, _ = run(cfg, stop_at=2)
    assert [row["step"] for row in first_rows] == [1, 2]
    resumed_rows, resumed_prompts, resumed_weights = run(cfg)
    assert [row["step"] for row in resumed_rows] == [1, 2, 3, 4]
    assert untimed(resumed_rows) == untimed(whole_rows)
    assert first_prompts + resumed_prompts == whole_prompts
    assert all(torch.equal(resumed_weights[k], whole_weights[k]) for k in whole_weights)
    flat = [p for batch in whole_prompts for p in batch]
    assert len(flat) == len(set(flat)) == 16  # no prompt trained twice


def test_fully_async_at_staleness_zero_refills_as_sync_does(data_dir, tiny_model_path, reward_file, tmp_path):
    sync_rows, _, sync_weights = run(config(data_dir, tiny_model_path, reward_file, tmp_path / "sync"))
    async_rows, _, async_weights = run(
        config(
            data_dir,
            tiny_model_path,
            reward_file,
            tmp_path / "async",
            "async_training.mode=fully_async",
            "async_training.max_staleness=0",
        )
    )
    assert untimed(async_rows) == untimed(sync_rows)
    assert all(torch.equal(async_weights[k], sync_weights[k]) for k in sync_weights)


def test_the_producer_oversamples_ahead_and_a_resume_continues_after_its_last_draw(
    data_dir, tiny_model_path, reward_file, tmp_path
):
    """One step off: the producer refills step b + 1 while step b trains; the checkpoint of step 1 (which
    took 3 generation batches) records the position after step 1's last draw (not after what the producer drew
    for step 2 meanwhile), and the resumed run draws on from there: each step trains prompts of the loader
    batches it drew, which follow each other."""
    cfg = config(
        data_dir,
        tiny_model_path,
        reward_file,
        tmp_path,
        "async_training.mode=one_step_off",
        "trainer.save_freq=1",
    )
    first_rows, first_trained, _ = run(cfg, stop_at=1)
    state = torch.load(tmp_path / "global_step_1" / "trainer_state.pt", weights_only=False)["loader"]
    assert first_rows[0]["dynamic_sampling/gen_batches"] == 3 == state["position"]
    rows, resumed, _ = run(cfg)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    loader = PPOTrainer(cfg).train_loader
    drawn = [prompts_of(batch) for _, batch in zip(range(16), loader)]  # the loader's batches in order
    start = 0
    for row, trained in zip(rows, first_trained + resumed):
        count = int(row["dynamic_sampling/gen_batches"])
        assert set(trained) <= {p for batch in drawn[start : start + count] for p in batch}
        start += count
    assert start > 4  # the producer refilled some batch


# ------------------------------------------------------------------------------- other rollouts
SERVED_AGENT = """
async def run(client, sample):
    reply = await client.chat.completions.create(model="policy", messages=sample["messages"], max_tokens=4)
    return float(len(reply.choices[0].message.content) % 2)
"""


@pytest.mark.parametrize("rollout", ["agent_loop", "served"])
def test_the_agent_loop_and_a_served_agent_refill_too(
    data_dir, tiny_model_path, reward_file, tmp_path, rollout
):
    if rollout == "agent_loop":
        (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: calculator\n")
        extra = [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
        ]
    else:
        (tmp_path / "agent.py").write_text(SERVED_AGENT)
        # the agent's return value is the reward: no reward file beside it
        extra = [
            f"actor_rollout_ref.rollout.served_agent.path={tmp_path / 'agent.py'}",
            "custom_reward_function.path=null",
        ]
    batches = []
    cfg = config(
        data_dir, tiny_model_path, reward_file, tmp_path / "run", "trainer.total_training_steps=2", *extra
    )
    with PPOTrainer(cfg) as trainer:
        trainer.register_hook("after_reward", lambda t, step, m, batch: batches.append(batch))
        trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["dynamic_sampling/full_batch"] == 1.0 for row in rows)
    for batch in batches:
        uids = batch.non_tensor_batch["uid"]
        assert len(set(uids)) == 4
        scores = batch.batch["token_level_scores"].sum(-1)
        for uid in set(uids):
            group = scores[torch.as_tensor(uids == uid)]
            assert group.max() > group.min()


def test_settings_that_would_filter_nothing_are_refused(data_dir, tiny_model_path, reward_file, tmp_path):
    with pytest.raises(ConfigError, match="rollout.n=1 every group is one sample"):
        config(
            data_dir,
            tiny_model_path,
            reward_file,
            tmp_path,
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        )
    with pytest.raises(
        ConfigError, match="data.gen_batch_size=8 .* needs algorithm.filter_groups.enable=true"
    ):
        config(
            data_dir,
            tiny_model_path,
            reward_file,
            tmp_path,
            "algorithm.filter_groups.enable=false",
            "data.gen_batch_size=8",
        )
