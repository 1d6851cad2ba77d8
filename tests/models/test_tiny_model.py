import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.models import make_tiny_model
from hybridflow.models.tiny import main, reply_mask, teach_conversations


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_build_is_fast_and_reproducible(tmp_path):
    start = time.perf_counter()
    a = make_tiny_model(tmp_path / "a", seed=3)
    assert time.perf_counter() - start < 10
    b = make_tiny_model(tmp_path / "b", seed=3)
    c = make_tiny_model(tmp_path / "c", seed=4)
    wa, wb, wc = (AutoModelForCausalLM.from_pretrained(p).model.embed_tokens.weight for p in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "c" / "tokenizer.json").read_text()


def test_loads_with_plain_transformers(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert len(tok) == 1024 == model.config.vocab_size
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == im_end
    assert (Path(tiny_dir) / "model.safetensors").is_file()
    assert json.loads((Path(tiny_dir) / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize(
    "text",
    [
        "Compute 14+27. Reply in the form 14+27=<answer>.",
        "  two  spaces, tabs\tand\nnew lines \n",
        "unicode: héllo wörld, 日本語, emoji 🙂",
        "<answer>(3 + 7) * 12</answer>",
    ],
)
def test_tokenizer_round_trips_exactly(tiny_dir, text):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.decode(tok(text)["input_ids"]) == text


def test_common_text_gets_merged_tokens(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    # 48 characters; byte-level with no merges would need 48 tokens.
    assert len(tok("Compute 14+27. Reply in the form 14+27=<answer>.")["input_ids"]) < 20


def test_chat_template_and_generation(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    messages = [{"role": "user", "content": "Compute 1+2."}, {"role": "assistant", "content": "1+2=3"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nCompute 1+2.<|im_end|>\n<|im_start|>assistant\n1+2=3<|im_end|>\n"
    prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tok.convert_tokens_to_ids("<|im_start|>")
    out = model.generate(ids, max_new_tokens=8, do_sample=True)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 8
    assert torch.equal(out[0, : ids.shape[1]], ids[0])


def test_cli_main(tmp_path, capsys):
    assert main([str(tmp_path / "m"), "--vocab-size", "512", "--hidden-size", "32", "--seed", "1"]) == 0
    assert str(tmp_path / "m") in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert (model.config.vocab_size, model.config.hidden_size) == (512, 32)


ONE_SHOT = [
    {"role": "user", "content": "Compute 1+2."},
    {"role": "assistant", "content": "1+2=3"},  # part of the prompt: the rollout never writes it
    {"role": "user", "content": "Compute 3+4."},
    {"role": "assistant", "content": "call add"},
    {"role": "tool", "content": "7"},
    {"role": "assistant", "content": "3+4=7"},
]


def test_reply_mask_marks_the_turns_after_the_last_user_message(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids, mask = reply_mask(tok, ONE_SHOT)
    assert tok.decode(ids) == tok.apply_chat_template(ONE_SHOT, tokenize=False)
    marked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert marked == "call add<|im_end|>\n3+4=7<|im_end|>\n"
    with pytest.raises(ValueError, match="no assistant reply after the last user message"):
        reply_mask(tok, ONE_SHOT[:3])


@pytest.mark.learning
def test_teaching_stops_at_the_margin_and_greedy_decoding_writes_the_replies(tmp_path):
    chats = [ONE_SHOT, [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]]
    folder = teach_conversations(make_tiny_model(tmp_path / "m"), chats)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    for chat in chats:
        ids, mask = reply_mask(tok, chat)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
        probs = logits.softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert probs[torch.tensor(mask[1:])].min() >= 0.99  # every reply token, at the margin asked for
        prompt = tok.apply_chat_template(chat[:-1], add_generation_prompt=True, return_tensors="pt")
        prompt = prompt if torch.is_tensor(prompt) else prompt["input_ids"]
        out = model.generate(prompt, max_new_tokens=16, do_sample=False)
        assert tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True) == chat[-1]["content"]


def test_teaching_what_cannot_be_learned_names_the_token(tmp_path):
    question = [{"role": "user", "content": "Say hi."}]
    chats = [
        question + [{"role": "assistant", "content": a}] for a in ("hi", "ho")
    ]  # one prompt, two replies
    with pytest.raises(ValueError, match=r"after 30 steps .* probability 0\.[0-9]+ < min_prob 0\.99"):
        teach_conversations(make_tiny_model(tmp_path / "m"), chats, max_steps=30)
