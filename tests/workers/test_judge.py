"""Judges (``reward_model.style=generative``): the parsers, a taught tiny judge in the reward model's worker and
served by ``hybridflow serve`` on loopback, failures scored by the rule, and judge + rule in a PPO step."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.config.schema import JudgeConfig, PPOConfig
from hybridflow.models.tiny import make_tiny_model, teach_conversations
from hybridflow.rewards.judge import EndpointJudge, parse_verdict, render, yes_probability
from hybridflow.single_controller import ClassWithInitArgs, LocalWorkerGroup
from hybridflow.workers import RewardModelWorker
from hybridflow.workers.modeling import load_tokenizer

NUMBER = "Question: {prompt}\nAnswer: {response}\nScore 0-10:"
VERDICT = "Is {response} the answer to {prompt}? yes or no:"
QUESTION = "Compute 21+34."
RIGHT, WRONG = "21+34=55", "21+34=58"


def judge_chats() -> list[list[dict[str, str]]]:
    """What the judge is taught: a 9 for the right answer, a 2 for the wrong one; yes / no likewise."""
    chats = []
    for template, right, wrong in ((NUMBER, "9", "2"), (VERDICT, "yes", "no")):
        for response, reply in ((RIGHT, right), (WRONG, wrong)):
            content = render(template, QUESTION, response, "55")
            chats.append([{"role": "user", "content": content}, {"role": "assistant", "content": reply}])
    return chats


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    folder = make_tiny_model(tmp_path_factory.mktemp("judge") / "model")
    return teach_conversations(folder, judge_chats())


def test_the_parsers_read_numbers_in_range_and_whole_verdict_words():
    config = JudgeConfig(score_range=[0.0, 10.0])
    assert parse_verdict("Score: 7/10", config) == pytest.approx(0.7)
    assert parse_verdict("12", config) is None and parse_verdict("no idea", config) is None
    verdict = JudgeConfig(parser="verdict", yes_words=["yes", "correct"], no_words=["no", "incorrect"])
    assert parse_verdict("Correct, well done", verdict) == 1.0
    assert parse_verdict("I know it is INCORRECT", verdict) == 0.0  # 'know' is not 'no'
    assert parse_verdict("maybe", verdict) is None
    assert yes_probability(" Yes", math.log(0.8), verdict) == pytest.approx(0.8)
    assert yes_probability("no", math.log(0.8), verdict) == pytest.approx(0.2)
    assert yes_probability("y", math.log(0.9), verdict) == pytest.approx(0.9)  # a word's first piece
    assert yes_probability("perhaps", 0.0, verdict) is None
    assert render("{prompt}|{response}|{ground_truth}|{other}", "q", "r", 5) == "q|r|5|{other}"


def with_responses(batch, tokenizer, answers: list[str], width: int = 12):
    """A rollout-like batch: the prompts, then hand-written responses."""
    ids = [tokenizer(a, add_special_tokens=False)["input_ids"][:width] for a in answers]
    batch.batch["responses"] = torch.tensor(
        [row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids]
    )
    batch.batch["response_mask"] = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    batch.non_tensor_batch["ground_truth"] = np.array(["55"] * len(answers), dtype=object)
    return batch


def judged(judge_model, chat_prompts, template: str, parser: str, answers: list[str], **judge) -> tuple:
    """A generative reward model's scores, verdicts and metrics for ``answers`` to QUESTION."""
    cfg = PPOConfig().reward_model
    cfg.enable, cfg.style, cfg.model.path = True, "generative", judge_model
    cfg.judge = JudgeConfig(prompt_template=template, parser=parser, max_tokens=4, **judge)
    group = LocalWorkerGroup(ClassWithInitArgs(RewardModelWorker, cfg, policy_tokenizer_path=judge_model))
    group.init_model()
    tokenizer = load_tokenizer(judge_model)
    batch = with_responses(chat_prompts(tokenizer, [QUESTION] * len(answers)), tokenizer, answers)
    out = group.compute_rm_score(batch)
    return out.batch["rm_scores"].sum(-1).tolist(), list(out.non_tensor_batch["judge_verdict"]), out.meta_info


def test_a_judge_in_the_worker_scores_by_number_verdict_and_yes_probability(judge_model, chat_prompts):
    scores, verdicts, meta = judged(judge_model, chat_prompts, NUMBER, "number", [RIGHT, WRONG])
    assert scores == pytest.approx([0.9, 0.2]) and [v.strip() for v in verdicts] == ["9", "2"]
    assert meta["metrics"]["reward/judge/failures"] == [0.0]
    scores, verdicts, _ = judged(judge_model, chat_prompts, VERDICT, "verdict", [RIGHT, WRONG])
    assert scores == [1.0, 0.0]
    probabilities, verdicts, _ = judged(judge_model, chat_prompts, VERDICT, "yes_probability", [RIGHT, WRONG])
    assert probabilities[0] > 0.9 and probabilities[1] < 0.1 and verdicts[0].startswith("p(yes)=")


def test_unparsable_verdicts_score_the_failure_score_and_are_counted(judge_model, chat_prompts):
    """The number judge asked a verdict question answers yes/no: no number in range, so the rule applies."""
    scores, verdicts, meta = judged(
        judge_model, chat_prompts, VERDICT, "number", [RIGHT, WRONG], failure_score=-1.0
    )
    assert scores == [-1.0, -1.0] and meta["metrics"]["reward/judge/failures"] == [2.0]
    assert [v.strip() for v in verdicts] == ["yes", "no"]  # the raw replies are kept


def test_a_judge_served_by_hybridflow_serve_on_loopback(judge_model):
    from tests.serving.conftest import start_server, stop

    process, url = start_server(judge_model, "--max-tokens", "8")
    try:
        prompts = [render(NUMBER, QUESTION, answer, "55") for answer in (RIGHT, WRONG, "ZZZ")]
        verdicts = EndpointJudge(JudgeConfig(base_url=url, prompt_template=NUMBER, max_tokens=4)).judge(
            prompts
        )
        assert [v.score for v in verdicts[:2]] == pytest.approx([0.9, 0.2]) and not verdicts[0].failed
        yes = [render(VERDICT, QUESTION, a, "55") for a in (RIGHT, WRONG)]
        probability = EndpointJudge(JudgeConfig(base_url=url, parser="yes_probability")).judge(yes)
        assert probability[0].score > 0.9 and probability[1].score < 0.1
    finally:
        stop(process)
    down = EndpointJudge(JudgeConfig(base_url=url, model="judge", request_timeout_s=5.0)).judge(prompts[:2])
    assert [v.failed for v in down] == [True, True] and [v.score for v in down] == [0.0, 0.0]
    assert "Connection refused" in down[0].text or "URLError" in down[0].text


def judge_ppo_config(tmp_path, judge_model, data_dir, *extra: str):
    return load_config(
        [
            f"data.train_files={data_dir / 'train.parquet'}",
            f"data.val_files={data_dir / 'test.parquet'}",
            "data.train_batch_size=2",
            "data.val_batch_size=2",
            "data.max_response_length=8",
            f"actor_rollout_ref.model.path={judge_model}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.n=2",
            "algorithm.adv_estimator=grpo",
            "reward_model.enable=true",
            "reward_model.style=generative",
            f"reward_model.model.path={judge_model}",
            "reward_model.judge.max_tokens=2",
            "trainer.total_training_steps=1",
            "trainer.log_val_generations=2",
            "trainer.logger=[file]",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            *extra,
        ]
    )


def test_ppo_with_a_judge_plus_the_rule_and_its_verdicts_in_the_samples(tmp_path, judge_model, data_dir):
    """reward = model_weight x judge + rule_weight x rule, the failures metric logged, and validation keeps
    the judge's raw verdicts with the samples the report shows."""
    from hybridflow.trainer import PPOTrainer

    config = judge_ppo_config(
        tmp_path, judge_model, data_dir, "reward_model.model_weight=0.5", "reward_model.rule_weight=2.0"
    )
    with PPOTrainer(config) as trainer:
        trainer.init_workers()
        batch = trainer.rollouts.generate_now(next(iter(trainer.train_loader)), 0)
        judge = trainer.wg.reward_model.compute_rm_score(batch).batch["rm_scores"].sum(-1)
        rule = trainer.reward_fn(batch, return_dict=True)["reward_tensor"].sum(-1)
        metrics: dict[str, float] = {}
        scored = trainer.compute_reward(batch, metrics).batch["token_level_scores"].sum(-1)
        assert scored.tolist() == pytest.approx((0.5 * judge + 2.0 * rule).tolist())
        assert "reward/judge/failures" in metrics and "judge_verdict" in batch.non_tensor_batch
        trainer.fit()
    samples = [
        json.loads(line) for line in (tmp_path / "run" / "val_generations.jsonl").read_text().splitlines()
    ]
    assert samples and all(isinstance(s["verdict"], str) for s in samples)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val/arithmetic/judge/mean@1" in m for m in logged)
    assert any("reward/judge/failures" in m for m in logged)


def test_two_stage_the_rule_ranks_and_the_judge_rescores_the_best(tmp_path, judge_model, data_dir):
    from hybridflow.trainer import PPOTrainer

    config = judge_ppo_config(
        tmp_path,
        judge_model,
        data_dir,
        "reward_model.two_stage.enable=true",
        "reward_model.two_stage.top_k_ratio=0.5",
    )
    with PPOTrainer(config) as trainer:
        trainer.init_workers()
        batch = trainer.rollouts.generate_now(next(iter(trainer.train_loader)), 0)
        metrics: dict[str, float] = {}
        trainer.compute_reward(batch, metrics)
    assert (
        metrics["reward/stage1_calls"] == 4 and metrics["reward/stage2_calls"] == 2
    )  # one of each group's two


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["reward_model.style=generative", "reward_model.judge.prompt_template=hi"],
            "must contain {response}",
        ),
        (
            ["reward_model.judge.base_url=http://127.0.0.1:9/v1"],
            "the judge only scores with reward_model.style",
        ),
        (["reward_model.judge.score_range=[5,5]"], "low < high"),
        (["reward_model.rule_weight=1", "reward_model.two_stage.enable=true"], "choose one"),
    ],
)
def test_judge_settings_that_cannot_work_are_refused_naming_the_key(overrides, message, tiny_model_path):
    from hybridflow.config.checks import ConfigError

    base = [
        "data.train_files=x.parquet",
        "reward_model.enable=true",
        f"reward_model.model.path={tiny_model_path}",
    ]
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        load_config([*base, "algorithm.adv_estimator=grpo", *overrides])
