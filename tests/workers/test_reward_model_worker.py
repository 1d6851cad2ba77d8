import logging

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from hybridflow import DataProto
from hybridflow.config.schema import PPOConfig
from hybridflow.single_controller import ClassWithInitArgs, LocalWorkerGroup, WorkerError
from hybridflow.workers import CriticWorker, RewardModelWorker
from hybridflow.workers.modeling import load_tokenizer


def generated(tokenizer, chat_prompts, answers: list[str], width: int = 8) -> DataProto:
    """A batch laid out as the rollout returns it, with hand-written responses."""
    batch = chat_prompts(tokenizer, [f"question {i}" for i in range(len(answers))])
    responses = torch.full((len(answers), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(answers), width, dtype=torch.long)
    for i, text in enumerate(answers):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:width]
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    batch.batch["responses"] = responses
    batch.batch["response_mask"] = mask
    return batch


def rm_group(path: str | None, dummy: bool, policy_path: str) -> LocalWorkerGroup:
    cfg = PPOConfig().reward_model
    cfg.enable, cfg.dummy, cfg.model.path = True, dummy, path
    group = LocalWorkerGroup(ClassWithInitArgs(RewardModelWorker, cfg, policy_tokenizer_path=policy_path))
    group.init_model()
    return group


def test_reward_model_scores_the_rendered_conversation(tiny_model_path, chat_prompts):
    tokenizer = load_tokenizer(tiny_model_path)
    batch = generated(tokenizer, chat_prompts, ["4", "the answer is 7", "no"])
    worker = rm_group(tiny_model_path, False, tiny_model_path).workers[0]
    # the same weights (the score head is fresh), run by plain transformers on the conversation the worker renders
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.load_state_dict(worker.model.state_dict())
    expected = []
    for i, answer in enumerate(["4", "the answer is 7", "no"]):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": answer}],
            tokenize=False,
        )
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        expected.append(model(**inputs).logits[0, 0].item())
    scores = worker.compute_rm_score(batch).batch["rm_scores"]
    last = batch.batch["response_mask"].sum(-1) - 1
    assert scores[torch.arange(3), last].tolist() == pytest.approx(expected, abs=1e-5)
    assert (scores != 0).sum() == 3  # only each response's last token carries the score


def test_dummy_reward_model_varies_with_length_and_content(tiny_model_path, chat_prompts):
    """It used to saturate at 1.0 (length only), so a smoke run showed a flat reward."""
    tokenizer = load_tokenizer(tiny_model_path)
    batch = generated(tokenizer, chat_prompts, ["x"] * 4, width=8)
    batch.batch["responses"][:] = torch.tensor(
        [
            [5, 0, 0, 0, 0, 0, 0, 0],
            [5, 6, 5, 6, 0, 0, 0, 0],
            [5, 5, 5, 5, 5, 5, 5, 5],
            [1, 2, 3, 4, 5, 6, 7, 8],
        ]
    )
    batch.batch["response_mask"][:] = torch.tensor([[1] + [0] * 7, [1] * 4 + [0] * 4, [1] * 8, [1] * 8])
    group = rm_group(None, True, tiny_model_path)
    assert group.workers[0].model is None  # nothing loaded
    scores = group.compute_rm_score(batch).batch["rm_scores"].sum(-1)
    # 0.5 * length / 8 + 0.5 * distinct / length
    assert scores.tolist() == pytest.approx([0.5 / 8 + 0.5, 0.25 + 0.25, 0.5 + 0.5 / 8, 1.0])


def test_reward_model_without_chat_template_scores_plain_text(tiny_model_path, chat_prompts, tmp_path):
    """A plain sequence classifier (no chat template, like OPT-350m's safety classifier) used to crash in
    apply_chat_template; it now reads the prompt text, a newline and the response."""
    tokenizer = load_tokenizer(tiny_model_path)
    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    classifier.config.pad_token_id = tokenizer.pad_token_id
    plain_tokenizer = load_tokenizer(tiny_model_path)
    plain_tokenizer.chat_template = None
    classifier.save_pretrained(tmp_path / "rm")
    plain_tokenizer.save_pretrained(tmp_path / "rm")
    assert load_tokenizer(str(tmp_path / "rm")).chat_template is None
    batch = generated(tokenizer, chat_prompts, ["4", "the answer is 7"])
    worker = rm_group(str(tmp_path / "rm"), False, tiny_model_path).workers[0]
    scores = worker.compute_rm_score(batch).batch["rm_scores"].sum(-1)
    expected = [
        classifier(**plain_tokenizer(f"question {i}\n{answer}", return_tensors="pt")).logits[0, 0].item()
        for i, answer in enumerate(["4", "the answer is 7"])
    ]
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)
    cfg = PPOConfig().reward_model
    cfg.enable, cfg.model.path, cfg.input_format = True, str(tmp_path / "rm"), "chat"
    chat_group = LocalWorkerGroup(
        ClassWithInitArgs(RewardModelWorker, cfg, policy_tokenizer_path=tiny_model_path)
    )
    with pytest.raises(
        WorkerError,
        match="reward_model.input_format=chat, but the tokenizer of .* has no chat "
        "template; set reward_model.input_format=plain",
    ):
        chat_group.init_model()


def test_critic_says_its_value_head_is_new_instead_of_a_missing_table(tiny_model_path, capfd, caplog):
    cfg = PPOConfig().resolve()
    cfg.critic.model.path = tiny_model_path
    with caplog.at_level(logging.INFO, logger="hybridflow"):
        LocalWorkerGroup(ClassWithInitArgs(CriticWorker, cfg.critic)).init_model()
    assert "MISSING" not in capfd.readouterr().err
    notes = [r.getMessage() for r in caplog.records if r.name.startswith("hybridflow")]
    assert notes == [
        f"the critic's value head starts from scratch (score.bias, score.weight, as expected: "
        f"{tiny_model_path} holds no such head)"
    ]
