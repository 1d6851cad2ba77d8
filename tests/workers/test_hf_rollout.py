"""The Hugging Face rollout's own decoding loop: sampling by temperature, top-k and top-p, the prompt prefix
shared by a batch found and run once, rows that end leaving the batch, and greedy output equal to
``transformers``' ``generate``."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.config.schema import RolloutConfig
from hybridflow.rollout import SamplingParams
from hybridflow.workers.modeling import load_tokenizer
from hybridflow.workers.rollout import HFRollout
from hybridflow.workers.rollout.hf_rollout import common_prefix_length, draw, sample_tokens


def params(**kw) -> SamplingParams:
    values = dict(response_length=4, n=1, do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    return SamplingParams(**{**values, **kw})


LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, -1)


def test_draw_follows_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2]]).expand(20000, -1)
    counts = torch.bincount(draw(probs), minlength=4) / 20000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.0, 0.3, 0.2]), atol=0.015, rtol=0)


@pytest.mark.parametrize(
    "kw,allowed",
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.5}, {0}),
        ({"top_p": 0.7}, {0, 1}),
        ({"top_p": 0.85}, {0, 1, 2}),
        ({}, {0, 1, 2, 3}),
    ],
)
def test_top_k_and_top_p_keep_the_right_tokens(kw, allowed):
    torch.manual_seed(0)
    tokens, log_probs = sample_tokens(LOGITS, params(**kw))
    assert set(tokens.tolist()) == allowed
    # the log-prob is the token's under the temperature alone (what the trainer's forward computes)
    torch.testing.assert_close(log_probs, LOGITS[0].log_softmax(-1)[tokens])


def test_temperature_scales_the_log_probs_and_greedy_takes_the_argmax():
    torch.manual_seed(0)
    tokens, log_probs = sample_tokens(LOGITS[:8], params(temperature=0.5))
    p = [0.5, 0.3, 0.15, 0.05]
    expected = [math.log(p[t] ** 2 / sum(q**2 for q in p)) for t in tokens.tolist()]  # T 0.5 squares p
    assert log_probs.tolist() == pytest.approx(expected, rel=1e-5)
    tokens, log_probs = sample_tokens(LOGITS[:3], params(do_sample=False))
    assert tokens.tolist() == [0, 0, 0] and log_probs.tolist() == [0, 0, 0]


def test_common_prefix_of_left_padded_prompts():
    ids = torch.tensor([[0, 0, 7, 8, 9, 4], [7, 8, 9, 5, 6, 2], [0, 7, 8, 3, 3, 3]])
    mask = (ids != 0).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    assert common_prefix_length(ids, mask, positions) == 2  # 7 8
    assert common_prefix_length(ids[:2], mask[:2], positions[:2]) == 3  # 7 8 9, short of row 0's last token
    assert (
        common_prefix_length(ids[:1].expand(2, -1), mask[:1].expand(2, -1), positions[:1].expand(2, -1)) == 3
    )


def test_greedy_equals_generate_with_a_shared_prefix_and_rows_ending_early(tiny_model_path, chat_prompts):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    with torch.no_grad():  # larger random weights than the init's: prompts get different greedy answers
        for weight in model.parameters():
            if weight.dim() > 1:
                weight.normal_(0, 0.2)
    tokenizer = load_tokenizer(tiny_model_path)
    prompts = chat_prompts(
        tokenizer, ["Compute 1+2.", "Say hello to the world please.", "Hi", "What is 12+7?"]
    )
    b = prompts.batch
    assert common_prefix_length(b["input_ids"], b["attention_mask"], b["position_ids"]) >= 3

    def generate(eos: list[int] | None) -> torch.Tensor:
        return model.generate(
            b["input_ids"],
            attention_mask=b["attention_mask"],
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
        )[:, b["input_ids"].shape[1] :]

    free = generate(None)
    eos = [int(free[0, 2]), int(free[1, 5])]  # the first row ends at its third token, the second at its sixth
    model.generation_config.eos_token_id = eos
    out = HFRollout(model, tokenizer, RolloutConfig(n=2, do_sample=False), 12).generate_sequences(prompts)
    expected = generate(eos)
    lengths = out.batch["response_mask"].sum(1)
    assert lengths.tolist() == [3, 3, 6, 6, 12, 12, 12, 12]
    for row in range(len(out)):
        n = int(lengths[row])
        assert out.batch["responses"][row, :n].tolist() == expected[row // 2, :n].tolist(), row
        assert (out.batch["responses"][row, n:] == tokenizer.pad_token_id).all()
