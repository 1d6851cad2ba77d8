"""``data.apply_chat_template=false``: string prompts (and offline completions) are fed as they are, for
pre-rendered text and base models without a chat template, in RL and in the SFT, DPO and KTO trainers.
Before, a string prompt was always chat-templated (ChatML headers around it)."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hybridflow.config.offline import DPOConfig, KTOConfig, SFTConfig, load_offline_config
from hybridflow.trainer import PPOTrainer, load_config
from hybridflow.trainer.offline import OfflineTrainer

PROMPT = "Question: what is 12+30?\nAnswer:"  # pre-rendered few-shot style text, as for a base model
COMPLETIONS = {"good": " 42", "bad": " 41"}


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rl_prompts_are_the_plain_tokenizer_output(tiny_model_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    files = _jsonl(tmp_path / "p.jsonl", [{"prompt": PROMPT, "reward_model": {"ground_truth": "42"}}])
    common = [f"data.train_files={files}", f"actor_rollout_ref.model.path={tiny_model_path}"]
    common += [f"trainer.default_local_dir={tmp_path / 'run'}", "data.train_batch_size=1"]
    common += ["actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=4"]
    for raw in (False, True):
        trainer = PPOTrainer(load_config([*common, f"data.apply_chat_template={not raw}"]))
        item = trainer.train_loader.dataset[0]
        ids = item["input_ids"][item["attention_mask"].bool()].tolist()
        assert (ids == tok(PROMPT)["input_ids"]) == raw, tok.decode(ids)
        trainer.close()


@pytest.mark.parametrize(
    ("cls", "row", "completions"),
    [
        (SFTConfig, {"prompt": PROMPT, "response": " 42"}, [" 42"]),
        (DPOConfig, {"prompt": PROMPT, "chosen": " 42", "rejected": " 41"}, [" 42", " 41"]),
        (KTOConfig, {"prompt": PROMPT, "completion": " 42", "label": True}, [" 42"]),
    ],
)
def test_offline_strings_are_fed_as_they_are(tiny_model_path, tmp_path, cls, row, completions):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    files = _jsonl(tmp_path / "d.jsonl", [row, row])
    overrides = [f"data.train_files={files}", f"model.partial_pretrain={tiny_model_path}"]
    overrides += [f"trainer.default_local_dir={tmp_path / 'run'}", "data.train_batch_size=2"]
    overrides += ["data.micro_batch_size_per_gpu=2", "data.apply_chat_template=false"]
    trainer = OfflineTrainer(load_offline_config(cls, overrides))
    samples = trainer.train_loader.dataset[0][: len(completions)]
    for sample, completion in zip(samples, completions):
        assert sample.prompt == tok(PROMPT)["input_ids"]
        assert sample.response == tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert sample.loss_mask == [1] * len(sample.response)
    trainer.close()

    templated = OfflineTrainer(load_offline_config(cls, overrides[:-1]))  # the default: chat-templated
    sample = templated.train_loader.dataset[0][0]
    assert tok.decode(sample.prompt) == tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    templated.close()


def test_offline_chat_messages_need_the_template(tiny_model_path, tmp_path):
    files = _jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    overrides = [f"data.train_files={files}", f"model.partial_pretrain={tiny_model_path}"]
    overrides += [f"trainer.default_local_dir={tmp_path / 'run'}", "data.apply_chat_template=false"]
    with pytest.raises(
        ValueError, match=r"row 0: field 'messages' must be a string with data.apply_chat_template"
    ):
        OfflineTrainer(load_offline_config(SFTConfig, overrides))
