"""Asynchronous RL on the tiny model: a staleness bound of 0 reproduces sync bit for bit, one-step-off is
reproducible and exactly one step stale, fully async stays within its bound with partial rollouts, and the
metrics of every step say so."""

import json
import os
import random
import signal
import traceback
from pathlib import Path

import pytest
import torch
from tiny_runs import reward_written, run_settings

from hybridflow.trainer import PPOTrainer, load_config

# metrics that measure time, or the asynchronous machinery itself, differ between otherwise identical runs
# (a sync run has no async/ metrics at all)
TIMED = ("timing_s/", "perf/", "async/")

# A reward every sample of the random tiny model earns a different share of (the task's own is 0 for all of
# them, which would leave the advantages, and so the updates, at zero).
DIGIT_SHARE_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    return reward_written(tmp_path_factory, "digits.py", DIGIT_SHARE_REWARD)


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
            "trainer.total_training_steps=4",
            *overrides,
        )
    )


def run(cfg) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Each step's metrics and the actor's final weights."""
    with PPOTrainer(cfg) as trainer:
        trainer.fit()
        weights = {
            k: torch.from_numpy(v.copy()) for k, v in trainer.wg.actor_rollout.get_weights()[0].items()
        }
    rows = Path(cfg.trainer.default_local_dir, "metrics.jsonl").read_text().splitlines()
    return [json.loads(row) for row in rows], weights


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMED)} for row in rows]


def test_staleness_zero_is_sync_bit_for_bit(data_dir, tiny_model_path, reward_file, tmp_path):
    sync_rows, sync_weights = run(config(data_dir, tiny_model_path, reward_file, tmp_path / "sync"))
    async_rows, async_weights = run(
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
    assert [row["async/staleness_max"] for row in async_rows] == [0.0] * 4
    assert async_weights.keys() == sync_weights.keys()
    assert all(torch.equal(async_weights[k], sync_weights[k]) for k in sync_weights)
    # and training moved the weights (the comparison is not between two untouched models)
    with PPOTrainer(config(data_dir, tiny_model_path, reward_file, tmp_path / "untrained")) as fresh:
        fresh.init_workers()
        start = fresh.wg.actor_rollout.get_weights()[0]
    assert any(not torch.equal(torch.from_numpy(start[k].copy()), sync_weights[k]) for k in start)


def test_one_step_off_is_reproducible_and_one_step_stale(data_dir, tiny_model_path, reward_file, tmp_path):
    runs = [
        run(
            config(
                data_dir, tiny_model_path, reward_file, tmp_path / name, "async_training.mode=one_step_off"
            )
        )
        for name in ("a", "b")
    ]
    (rows_a, weights_a), (rows_b, weights_b) = runs
    assert untimed(rows_a) == untimed(rows_b)
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    # batch 0 and 1 come from the initial weights, batch b >= 1 from the weights of step b - 1
    assert [row["async/weight_version_max"] for row in rows_a] == [0.0, 0.0, 1.0, 2.0]
    assert [row["async/staleness_max"] for row in rows_a] == [0.0, 1.0, 1.0, 1.0]
    # the report's histogram: every sample of a one-step-off batch is as stale as the batch
    samples = rows_a[0]["async/staleness_count/0"]
    assert (
        samples > 0
        and [
            (row.get("async/staleness_count/0", 0.0), row.get("async/staleness_count/1", 0.0))
            for row in rows_a
        ]
        == [(samples, 0.0)] + [(0.0, samples)] * 3
    )
    # stale batches are trained against the behaviour policy's log-probs: the ratio no longer starts at 1
    assert "actor/ppo_kl" not in rows_a[0] and rows_a[2]["actor/ppo_kl"] != 0.0  # step 0 is on-policy
    for row in rows_a:
        assert 0.0 <= row["async/rollout_idle_frac"] <= 1.0 and 0.0 <= row["async/trainer_idle_frac"] <= 1.0


def test_fully_async_with_partial_rollouts_stays_within_its_bound(
    data_dir, tiny_model_path, reward_file, tmp_path
):
    rows, _ = run(
        config(
            data_dir,
            tiny_model_path,
            reward_file,
            tmp_path,
            "async_training.mode=fully_async",
            "async_training.max_staleness=2",
            "trainer.total_training_steps=6",
            "actor_rollout_ref.actor.off_policy_mask=token_and_sequence",
        )
    )
    assert len(rows) == 6
    for row in rows:
        assert 0 <= row["async/staleness_max"] <= 2
        assert row["async/weight_version_max"] <= row["step"] - 1
        assert "off_policy/masked_frac" in row and "off_policy/ratio_mean" in row
    assert max(row["async/staleness_max"] for row in rows) >= 1  # the rollout did run ahead


@pytest.mark.parametrize(
    "overrides, culprit",
    [
        (["async_training.max_staleness=-1"], "async_training.max_staleness"),
        (["actor_rollout_ref.actor.off_policy_mask_bounds=[1.5,2.0]"], "off_policy_mask_bounds"),
        (["async_training.mode=one_step_off", "trainer.backend=ray"], "trainer.placement=split"),
        (
            ["async_training.mode=fully_async", "actor_rollout_ref.rollout.multi_turn.enable=true"],
            "partial_rollout",
        ),
    ],
)
def test_bad_async_settings_name_the_key(
    overrides, culprit, data_dir, tiny_model_path, reward_file, tmp_path
):
    with pytest.raises(ValueError, match=culprit):
        config(data_dir, tiny_model_path, reward_file, tmp_path, *overrides)


def prompts_of(batch) -> list[str]:
    """The batch's prompts in order, once each (a batch holds rollout.n samples of each)."""
    return list(dict.fromkeys(p[-1]["content"] for p in batch.non_tensor_batch["raw_prompt"]))


def killed_at_event(args_cfg, record: Path, event: int) -> None:
    """In a forked child: run, recording each trained step's prompts, and SIGKILL this process at its
    ``event``-th trainer stage or checkpoint fsync (the producer has samples in flight at most of them)."""
    count = 0

    def tick(*_: object) -> None:
        nonlocal count
        count += 1
        if count == event:
            os.kill(os.getpid(), signal.SIGKILL)

    fsync = os.fsync
    os.fsync = lambda fd: (tick(), fsync(fd))[1]
    code = 1
    try:
        trainer = PPOTrainer(args_cfg)
        trainer.register_hook("on_step_end", lambda t, step, m, batch: log_prompts(record, step, batch))
        for name in ("on_step_start", "after_generate", "after_advantage", "on_step_end", "on_checkpoint"):
            trainer.register_hook(name, tick)
        trainer.fit()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def log_prompts(record: Path, step: int, batch) -> None:
    with record.open("a") as f:
        f.write(json.dumps({"step": step, "prompts": prompts_of(batch)}) + "\n")


def test_a_killed_async_run_resumes_without_losing_or_repeating_a_prompt(
    data_dir, tiny_model_path, reward_file, tmp_path
):
    """SIGKILL at seeded random moments of a fully async run (staleness 2: up to two batches generated
    ahead), a resume after each: the steps that reached a checkpoint trained the loader's batches in order,
    each prompt once. Batches in flight at the kill are regenerated after the resume."""
    run_dir, record = tmp_path / "run", tmp_path / "trained.jsonl"
    cfg = config(
        data_dir,
        tiny_model_path,
        reward_file,
        run_dir,
        "async_training.mode=fully_async",
        "async_training.max_staleness=2",
        "trainer.total_training_steps=5",
        "trainer.save_freq=1",
    )
    rng = random.Random(22)
    statuses = []
    for _ in range(3):
        child = os.fork()
        if child == 0:
            killed_at_event(cfg, record, rng.randint(1, 60))
        _, status = os.waitpid(child, 0)
        statuses.append(status)
    assert signal.SIGKILL in statuses, statuses  # at least one run died mid-way
    assert all(s in (0, signal.SIGKILL) for s in statuses), statuses
    with PPOTrainer(cfg) as trainer:
        trainer.register_hook("on_step_end", lambda t, step, m, batch: log_prompts(record, step, batch))
        trainer.fit()
        loader = trainer.train_loader
        loader.load_state_dict({**loader.state_dict(), "epoch": 0, "position": 0})
        expected = [prompts_of(batch) for _, batch in zip(range(5), loader)]
    last = {}  # a step trained again after a kill before its checkpoint: the retrained one counts
    for line in record.read_text().splitlines():
        row = json.loads(line)
        last[row["step"]] = row["prompts"]
    assert sorted(last) == [1, 2, 3, 4, 5]
    trained = [last[step] for step in sorted(last)]
    assert trained == expected
    flat = [p for batch in trained for p in batch]
    assert len(flat) == len(set(flat)) == 20
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_on_ray_the_split_rollout_runs_ahead_within_its_bound(
    data_dir, tiny_model_path, reward_file, tmp_path, ray_session
):
    """Split placement with two rollout workers: each is its own Ray process, which generates its share of
    every batch and takes the weights posted while it generates (a second concurrent call); the batches they
    make stay within the staleness bound."""
    rows, _ = run(
        config(
            data_dir,
            tiny_model_path,
            reward_file,
            tmp_path,
            "trainer.backend=ray",
            "trainer.placement=split",
            "trainer.cpus_per_worker=0.5",
            "+trainer.resource_pool_spec.rollout=[2]",
            "async_training.mode=fully_async",
            "async_training.max_staleness=2",
        )
    )
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(0 <= row["async/staleness_max"] <= 2 for row in rows)
    assert max(row["async/staleness_max"] for row in rows) >= 1


def test_the_prompt_stream_keeps_a_batch_the_producer_has_not_fetched(
    data_dir, tiny_model_path, reward_file, tmp_path
):
    """With staleness 0 the trainer may take step 1's prompts before the producer fetches them (it wakes on
    the weights of step 0): the batch must still be there, the same one, and the checkpoint position after
    it. Before, the trainer's take forgot it and the producer failed with a KeyError."""
    from hybridflow.trainer.async_rollout import PromptStream

    loader = PPOTrainer(config(data_dir, tiny_model_path, reward_file, tmp_path)).train_loader
    stream = PromptStream(loader, 0)
    stream.get(0)
    first = stream.take(0)
    taken = stream.take(1)
    late, state = stream.get(1)
    assert prompts_of(late) == prompts_of(taken) != prompts_of(first)
    assert state == stream.trained_state and state["position"] == 2


def test_taking_batches_starts_nothing_the_run_starts_and_stops_the_producer(
    data_dir, tiny_model_path, reward_file, tmp_path
):
    """Before: ``batches()`` was a generator whose first ``next`` opened the prompt stream and started the
    producer's thread, as a side effect. Now ``start_rollouts`` (which ``fit`` calls) does both, once."""
    import threading

    def producers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "hybridflow-rollout"]

    with PPOTrainer(
        config(data_dir, tiny_model_path, reward_file, tmp_path, "async_training.mode=fully_async")
    ) as trainer:
        trainer.init_workers()
        with pytest.raises(RuntimeError, match=r"needs start_rollouts\(\) first"):
            trainer.batches()
        assert producers() == []
        trainer.start_rollouts()
        (producer,) = producers()
        first = next(trainer.batches())
        assert producers() == [producer] and len(first) == 4  # the prompts, taken: nothing else started
        trainer.rollouts.stop()
        assert producers() == []


def test_the_source_of_the_samples_is_chosen_by_mode_and_both_follow_one_contract():
    """Lock-step generation lives beside the contract and the choice (``trainer/rollouts.py``), not in the
    asynchronous module; each source has every method the trainer calls."""
    import inspect

    from hybridflow.trainer.async_rollout import AsyncRollouts
    from hybridflow.trainer.rollouts import Rollouts, SyncRollouts, build_rollouts

    def built(*overrides: str):
        return build_rollouts(load_config(["data.train_files=[a.parquet]", *overrides]), None, None)

    assert type(built()) is SyncRollouts
    one_step_off = built("async_training.mode=one_step_off")
    assert type(one_step_off) is AsyncRollouts and (one_step_off.max_staleness, one_step_off.exact) == (
        1,
        True,
    )
    whole = built(
        "async_training.mode=fully_async",
        "async_training.max_staleness=3",
        "async_training.partial_rollout=false",
    )
    assert (whole.max_staleness, whole.exact) == (3, True)
    contract = {
        name for name, _ in inspect.getmembers(Rollouts, inspect.isfunction) if not name.startswith("_")
    }
    assert contract == {"start", "take", "generate_now", "post_weights", "stop"}
    for source in (SyncRollouts, AsyncRollouts):
        assert all(
            inspect.signature(getattr(source, name)).parameters.keys()
            == inspect.signature(getattr(Rollouts, name)).parameters.keys()
            for name in contract
        ), source
    assert "SyncRollouts" not in inspect.getsource(inspect.getmodule(AsyncRollouts))
