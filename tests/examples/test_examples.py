"""Every script in examples/ runs and does what it says, checked on the values it produced."""

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.trainer import PPOTrainer
from hybridflow.trainer.loop import HookError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str):
    """Import ``examples/<name>.py`` (its folder on sys.path, as when it runs as a script)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def response_texts(batch, tokenizer) -> list[str]:
    """Each response decoded as RewardManager decodes it (masked, special tokens dropped)."""
    return [
        tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
        for ids, mask in zip(batch.batch["responses"], batch.batch["response_mask"])
    ]


def test_every_example_has_a_main_and_an_index_entry():
    scripts = sorted(p.stem for p in EXAMPLES.glob("[0-9][0-9]_*.py"))
    assert len(scripts) == 11
    index = (EXAMPLES / "README.md").read_text()
    for name in scripts:
        assert callable(example(name).main)
        assert f"{name}.py" in index


@pytest.mark.learning
def test_callbacks_halve_the_learning_rate_from_the_next_update(tmp_path):
    result = example("01_callbacks").main(tmp_path)
    lr = result["lr_by_step"]
    assert list(lr) == [1, 2, 3, 4, 5] and lr[1] == pytest.approx(1e-3)
    assert result["halved_after"], "the KL threshold never fired"
    for step in range(1, 5):
        factor = 0.5 if step in result["halved_after"] else 1.0
        assert lr[step + 1] == pytest.approx(lr[step] * factor), (step, lr, result["halved_after"])


def test_a_raising_hook_stops_the_run_and_the_last_checkpoint_still_loads(tmp_path):
    setup = example("_setup")
    config = setup.tiny_config(tmp_path, "trainer.save_freq=1", steps=3)

    def explode_at_step_2(trainer, step, metrics, batch):
        if step == 2:
            raise RuntimeError("boom")

    trainer = PPOTrainer(config)
    trainer.register_hook("on_step_end", explode_at_step_2)
    with pytest.raises(HookError, match=r"explode_at_step_2.*'on_step_end'.*step 2.*boom"):
        trainer.fit()
    assert sorted(p.name for p in (tmp_path / "run").glob("global_step_*")) == ["global_step_1"]
    resumed = PPOTrainer(config)
    resumed.init_workers()
    resumed.load_checkpoint()
    assert resumed.global_step == 1
    assert resumed.train_loader.position == 1  # the batch of step 2 is next


def test_replay_buffer_replays_rows_on_a_schedule_and_rescores_them(tmp_path):
    result = example("02_replay_buffer").main(tmp_path)
    rows = result["rows"]
    assert [r["replay/rows"] for r in rows] == [0, 4, 4, 4, 4, 4]  # nothing to replay before the first push
    assert [r["replay/buffer_size"] for r in rows] == [8, 16, 24, 32, 32, 32]  # capacity 32, 8 rows a step
    assert [r["replay/prioritized"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert [r["replay/alpha"] for r in rows[2:]] == [0.4, 0.4, 0.8, 0.8]
    assert rows[1]["replay/is_weight_mean"] == 1.0  # uniform sampling has no correction
    assert all(0 < r["replay/is_weight_mean"] < 1 for r in rows[2:])
    assert all(math.isfinite(r["replay/priority_mean"]) for r in rows[1:])
    assert result["rescored"] > 0 and result["buffer_size"] == 32


@pytest.mark.learning
def test_sft_loss_only_on_every_second_step_and_falling(tmp_path):
    result = example("03_sft_mixing").main(tmp_path)
    assert result["steps"] == [1, 2, 3, 4, 5, 6]
    loss = result["sft_loss"]
    assert list(loss) == [1, 3, 5]  # steps 0, 2, 4 done before the update: every_n_steps=2
    assert loss[1] > loss[3] > loss[5], loss


def test_two_stage_reward_calls_the_judge_on_30_percent_and_keeps_its_scores(tmp_path):
    module = example("04_two_stage_reward")
    result = module.main(tmp_path)
    calls = result["calls"]
    assert calls["cheap"] == 3 * 20  # 3 steps x 2 prompts x 10 samples
    assert calls["expensive"] <= 0.3 * calls["cheap"]  # at least 70 % fewer than judging every sample
    assert result["logged_stage2_calls"] == calls["expensive"]
    for batch in result["batches"]:
        texts = response_texts(batch, result["tokenizer"])
        final = batch.batch["token_level_scores"].sum(-1).tolist()
        cheap = batch.non_tensor_batch["reward_extra/stage1_score"].astype(float)
        chosen = batch.non_tensor_batch["reward_extra/stage2_selected"].astype(bool)
        for group in range(2):  # 3 of each prompt's 10 samples, those with the best cheap scores
            rows = slice(10 * group, 10 * group + 10)
            assert (
                chosen[rows].sum() == 3
                and cheap[rows][chosen[rows]].min() >= cheap[rows][~chosen[rows]].max()
            )
        for text, score, cheap_score, judged, truth in zip(
            texts, final, cheap, chosen, batch.non_tensor_batch["ground_truth"]
        ):
            expected = module.careful_judge("arithmetic", text, truth) if judged else 0.5 * cheap_score
            assert score == pytest.approx(expected, abs=1e-6), text


def test_routing_scores_each_category_its_own_way_in_the_original_order(tmp_path):
    module = example("05_routing")
    result = module.main(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    seen = set()
    for batch in result["batches"]:
        final = batch.batch["token_level_scores"]
        last = batch.batch["response_mask"].sum(-1) - 1
        assert torch.equal(final.nonzero()[:, 1], last[final.abs().sum(-1) > 0])  # on the last token only
        for text, score, extra, truth in zip(
            response_texts(batch, tokenizer),
            final.sum(-1).tolist(),
            batch.non_tensor_batch["extra_info"],
            batch.non_tensor_batch["ground_truth"],
        ):
            plain = module.digit_share("chat", text, truth)
            expected = {"creative": plain + 0.5, "factual": 1.0 if truth in text else -1.0}.get(
                extra["category"], plain
            )
            assert score == pytest.approx(expected, abs=1e-6), (extra, text)
            seen.add(extra["category"])
    assert seen == {"creative", "factual", "chat"}
    for row in result["rows"]:
        assert sum(v for k, v in row.items() if k.startswith("route/category/")) == 8


def test_custom_driver_runs_two_finite_steps(tmp_path):
    result = example("06_custom_driver").main(tmp_path)
    assert len(result["history"]) == 2 and result["finite"]
    for metrics in result["history"]:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss", "reward/mean"):
            assert np.isfinite(metrics[key]), key
    assert result["history"][1]["actor/kl_loss"] > 0  # the policy moved away from the reference after step 1


@pytest.mark.learning
def test_sft_then_dpo_then_grpo_each_from_the_previous_checkpoint(tmp_path):
    result = example("07_sft_dpo_grpo").main(tmp_path)
    sft, dpo = result["sft"], result["dpo"]
    assert sft[-1]["val/loss"] < sft[0]["val/loss"] - 0.5
    # DPO's policy and reference both start as the SFT checkpoint: loss ln 2, then the margin grows
    assert dpo[0]["val/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert dpo[-1]["val/rewards/margins"] > 0.02
    # each stage starts from the previous stage's checkpoint, which training changed
    assert str(result["sft_model"]).endswith("run_sft/global_step_4/actor/huggingface")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    tuned = AutoModelForCausalLM.from_pretrained(result["sft_model"])
    assert not torch.equal(base.lm_head.weight, tuned.lm_head.weight)
    assert result["grpo_model_path"] == str(result["dpo_model"])
    assert [row["step"] for row in result["grpo"]] == [1, 2]


@pytest.mark.learning
def test_custom_tool_is_called_in_rollouts_and_its_results_reach_the_reward(tmp_path):
    module = example("08_custom_tool")
    result = module.main(tmp_path)
    rows = result["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    assert (
        rows[0]["agent/tool_calls/mean"] > 0.5 and rows[0]["agent/tool_errors"] == 0
    )  # the taught model calls add ...
    assert rows[0]["critic/score/mean"] > 1.5  # ... with the prompt's numbers, and repeats the sum (2 points)
    for batch in result["batches"]:
        scores = batch.batch["token_level_scores"].sum(-1).tolist()
        for messages, calls, score, truth in zip(
            batch.non_tensor_batch["messages"],
            batch.non_tensor_batch["tool_calls"],
            scores,
            batch.non_tensor_batch["ground_truth"],
        ):
            for turn, reply in zip(calls, [m for m in messages if m["role"] == "tool"]):
                args = turn["calls"][0]["arguments"]
                if all(isinstance(args.get(k), int) for k in "ab"):  # AddTool's own result, not the model's
                    assert reply["content"] == str(args["a"] + args["b"])
                else:  # a sampled call can garble the arguments: the tool's error reaches the model
                    assert reply["content"].startswith("Error"), (args, reply)
            assert score == module.used_the_tool("arithmetic", "", truth, {"messages": messages})["score"]
        tool_tokens = batch.batch["attention_mask"][:, -128:].bool() & ~batch.batch["response_mask"].bool()
        assert tool_tokens.any()  # the model attends to tool output ...
        assert (batch.batch["advantages"][tool_tokens] == 0).all()  # ... which the loss leaves out


def test_an_openai_sdk_agent_trains_on_the_served_tokens(tmp_path):
    module = example("09_openai_agent")
    result = module.main(tmp_path)
    rows = result["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    assert (
        rows[0]["served/joined_calls"] > 0.3
    )  # the taught model calls the tool, and the answer continues it
    for batch in result["batches"]:
        rewards = batch.batch["rm_scores"].sum(-1).tolist()  # the agent's returns, attached by the rollout
        assert batch.batch["token_level_scores"].sum(-1).tolist() == pytest.approx(rewards)
        tool_tokens = batch.batch["attention_mask"][:, -256:].bool() & ~batch.batch["response_mask"].bool()
        assert tool_tokens.any()  # the tool results are in the rows, seen but not trained on
    assert max(ok for b in result["batches"] for ok in b.non_tensor_batch["reward_extra/tool_call_ok"]) == 1.0


def test_code_rewards_run_each_program_in_the_sandbox(tmp_path):
    from hybridflow.tools import sandbox
    from hybridflow.tools.sandbox import SandboxUnavailable

    try:
        sandbox.sandbox_mode()
    except SandboxUnavailable as err:
        pytest.skip(f"no sandbox on this machine: {err}")
    result = example("10_code_rewards").main(tmp_path)
    first = result["rows"][0]
    assert first["reward_extra/pass_rate/mean"] > 0  # the taught answers pass their tests in the sandbox
    assert first["reward_extra/syntax_error/mean"] < 1 and first["reward_extra/sandbox_s/mean"] > 0
    assert 0 < first["perf/reward_share"] < 1
    assert [step for step, _ in result["accuracy"]] == [0, 2]


def test_sft_then_a_reward_model_then_grpo_against_it(tmp_path):
    result = example("11_sft_rm_ppo").main(tmp_path)
    assert result["sft"][-1]["val/loss"] < result["sft"][0]["val/loss"]
    assert [r["step"] for r in result["rm"] if "train/loss" in r] == [1, 2, 3, 4]
    assert (result["rm_model"] / "config.json").exists()
    grpo = [r for r in result["grpo"] if "critic/score/mean" in r]
    assert len(grpo) == 2 and all(math.isfinite(r["critic/score/mean"]) for r in grpo)
    assert [step for step, _ in result["accuracy"]] == [0, 2]
