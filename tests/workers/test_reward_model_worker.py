import pytest
import torch
from transformers import AutoModelForSequenceClassification

from hybridflow import DataProto
from hybridflow.single_controller import ClassWithInitArgs, LocalWorkerGroup
from hybridflow.trainer.config import PPOConfig
from hybridflow.workers import RewardModelWorker
from hybridflow.workers.modeling import load_tokenizer


def generated(tokenizer, chat_prompts, answers: list[str], width: int = 8) -> DataProto:
    """A batch laid out as the rollout returns it, with hand-written responses."""
    batch = chat_prompts(tokenizer, [f"question {i}" for i in range(len(answers))])
    responses = torch.full((len(answers), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(answers), width, dtype=torch.long)
    for i, text in enumerate(answers):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:width]
        responses[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = 1
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
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"question {i}"},
                                              {"role": "assistant", "content": answer}], tokenize=False)
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        expected.append(model(**inputs).logits[0, 0].item())
    scores = worker.compute_rm_score(batch).batch["rm_scores"]
    last = batch.batch["response_mask"].sum(-1) - 1
    assert scores[torch.arange(3), last].tolist() == pytest.approx(expected, abs=1e-5)
    assert (scores != 0).sum() == 3  # only each response's last token carries the score


def test_dummy_reward_model_prefers_longer_answers(tiny_model_path, chat_prompts):
    tokenizer = load_tokenizer(tiny_model_path)
    batch = generated(tokenizer, chat_prompts, ["a", "a b c d", "a b c d e f g h i j k"], width=8)
    group = rm_group(None, True, tiny_model_path)
    assert group.workers[0].model is None  # nothing loaded
    scores = group.compute_rm_score(batch).batch["rm_scores"].sum(-1)
    lengths = batch.batch["response_mask"].sum(-1).float()
    assert scores.tolist() == pytest.approx((lengths / 8).clamp(max=1).tolist())
    assert scores[0] < scores[1] < scores[2] == 1.0
