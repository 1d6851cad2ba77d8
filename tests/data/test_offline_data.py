"""The offline datasets: assistant-only loss masks, interleaved preference pairs, KTO's mismatched pairs."""

import json

import pytest
import torch

from hybridflow.data.offline import KTODataset, PreferenceDataset, SFTConversationDataset
from hybridflow.data.prepare import main as prepare_data
from hybridflow.models import make_tiny_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Compute 12+30."},
    {"role": "assistant", "content": "12+30=42"},
    {"role": "user", "content": "And 40+1?"},
    {"role": "assistant", "content": "40+1=41"},
    {"role": "user", "content": "a trailing question nobody answered"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_multi_turn_sft_masks_everything_but_the_assistant_turns(tmp_path, tokenizer):
    data = SFTConversationDataset(write(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]), tokenizer)
    batch = data.collate([data[0]])
    ids, mask, responses = (
        batch.batch["input_ids"][0],
        batch.batch["response_mask"][0],
        batch.batch["responses"][0],
    )
    # the whole sequence is the template's rendering up to the last assistant turn
    rendered = tokenizer.apply_chat_template(CONVERSATION[:5], tokenize=False)
    assert tokenizer.decode(ids) == rendered
    # the prompt is what the model sees when it answers the first question
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(ids[: len(ids) - len(responses)]) == prompt
    # loss on exactly the assistant contents and their end-of-turn tokens: not the system/user turns, not the
    # "<|im_start|>assistant" headers, not the newline after <|im_end|>
    trained = tokenizer.decode(responses[mask.bool()])
    assert trained == "12+30=42<|im_end|>40+1=41<|im_end|>"
    assert mask[0] == 1 and mask[-1] == 0
    assert "And 40+1?" in tokenizer.decode(responses[~mask.bool()])


def test_prompt_response_rows_train_on_the_response_and_its_eos(tmp_path, tokenizer):
    data = SFTConversationDataset(
        write(
            tmp_path / "d.jsonl",
            [{"prompt": "Compute 1+2.", "response": "1+2=3"}, {"prompt": "Hi", "response": "Hello there"}],
        ),
        tokenizer,
    )
    batch = data.collate([data[0], data[1]])
    mask, responses = batch.batch["response_mask"], batch.batch["responses"]
    assert [tokenizer.decode(r[m.bool()]) for r, m in zip(responses, mask)] == [
        "1+2=3<|im_end|>",
        "Hello there<|im_end|>",
    ]
    # prompts left-padded, responses right-padded; attention covers the real tokens only
    attention = batch.batch["attention_mask"]
    width = responses.shape[1]
    assert (
        attention[:, -width:].sum(1)
        == torch.tensor([len(r) for r in (data[0][0].response, data[1][0].response)])
    ).all()
    assert batch.batch["position_ids"][0, -width] == attention[0, :-width].sum()


def test_assistant_turns_inside_the_prompt_are_context_not_targets(tmp_path, tokenizer):
    one_shot = CONVERSATION[1:4]  # user, assistant (an example answer), user
    data = SFTConversationDataset(
        write(tmp_path / "d.jsonl", [{"prompt": one_shot, "response": "40+1=41"}]), tokenizer
    )
    sample = data[0][0]
    assert tokenizer.decode(sample.prompt) == tokenizer.apply_chat_template(
        one_shot, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(sample.response) == "40+1=41<|im_end|>\n" and sample.loss_mask[-1] == 0


def test_preference_batch_interleaves_chosen_and_rejected(tmp_path, tokenizer):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Q{i}"}],
            "chosen": f"good {i}",
            "rejected": [{"role": "assistant", "content": f"bad {i}"}],
        }
        for i in range(2)
    ]
    data = PreferenceDataset(write(tmp_path / "p.jsonl", rows), tokenizer)
    batch = data.collate([data[0], data[1]])
    texts = [
        tokenizer.decode(r[m.bool()]) for r, m in zip(batch.batch["responses"], batch.batch["response_mask"])
    ]
    assert texts == ["good 0<|im_end|>", "bad 0<|im_end|>", "good 1<|im_end|>", "bad 1<|im_end|>"]


def test_kto_batch_appends_each_prompt_with_the_next_rows_completion(tmp_path, tokenizer):
    rows = [{"prompt": f"Q{i}", "completion": f"A{i}", "label": i != 1} for i in range(3)]
    data = KTODataset(write(tmp_path / "k.jsonl", rows), tokenizer)
    batch = data.collate([data[2], data[0], data[1]])
    texts = [
        tokenizer.decode(ids, skip_special_tokens=True).replace("\n", " ").split()
        for ids in batch.batch["input_ids"]
    ]
    pairs = [(words[1], words[3]) for words in texts]  # "user Qi assistant Aj"
    assert pairs == [("Q2", "A2"), ("Q0", "A0"), ("Q1", "A1"), ("Q2", "A0"), ("Q0", "A1"), ("Q1", "A2")]
    assert batch.batch["label"][:3].tolist() == [1, 1, 0]


def test_bad_rows_name_the_file_row_and_field(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"k.jsonl: row 1: field 'label' must be true or false, got 'yes'"):
        KTODataset(
            write(
                tmp_path / "k.jsonl",
                [
                    {"prompt": "a", "completion": "b", "label": True},
                    {"prompt": "a", "completion": "b", "label": "yes"},
                ],
            ),
            tokenizer,
        )
    with pytest.raises(ValueError, match=r"p.jsonl: row 0: field 'rejected' is missing"):
        PreferenceDataset(write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b"}]), tokenizer)
    long = write(tmp_path / "long.jsonl", [{"prompt": "word " * 50, "response": "ok"}])
    with pytest.raises(
        ValueError, match=r"long.jsonl: row 0: .* exceed max_length=16; raise data.max_length"
    ):
        SFTConversationDataset(long, tokenizer, max_length=16)
    kept = SFTConversationDataset(long, tokenizer, max_length=16, truncation="left")[0][0]
    assert len(kept.prompt) + len(kept.response) == 16 and sum(kept.loss_mask) > 0  # the response survives


def test_prepare_data_writes_offline_arithmetic_files(tmp_path, tokenizer):
    for fmt in ("sft", "dpo", "kto"):
        assert (
            prepare_data(
                ["arithmetic", str(tmp_path / fmt), "--format", fmt, "--train-size", "6", "--test-size", "2"]
            )
            == 0
        )
    sft = SFTConversationDataset(tmp_path / "sft" / "train.parquet", tokenizer)
    dpo = PreferenceDataset(tmp_path / "dpo" / "train.parquet", tokenizer)
    kto = KTODataset(tmp_path / "kto" / "train.parquet", tokenizer)
    assert (len(sft), len(dpo), len(kto)) == (6, 6, 12)
    import pyarrow.parquet as pq

    row = pq.read_table(tmp_path / "dpo" / "train.parquet").to_pylist()[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["chosen"] == f"{a}+{b}={a + b}"
    assert row["rejected"] in {f"{a}+{b}={a + b + d}" for d in (-10, -1, 1, 10)}
    kto_rows = pq.read_table(tmp_path / "kto" / "train.parquet").to_pylist()
    assert [r["label"] for r in kto_rows[:2]] == [True, False] and kto_rows[0]["completion"] == row["chosen"]


def test_rejected_replies_sampled_from_the_model_are_wrong(tiny_model_path):
    from hybridflow.data.offline_tasks import model_wrong_replies
    from hybridflow.data.prepare import arithmetic_splits
    from hybridflow.rewards import arithmetic

    rows, _ = arithmetic_splits(3, 0, seed=1)
    wrong, accuracy = model_wrong_replies(rows, tiny_model_path, samples=2, max_new_tokens=4)
    assert len(wrong) == 3 and 0.0 <= accuracy <= 1.0
    for row, reply in zip(rows, wrong):
        assert (
            reply
            and arithmetic.compute_score(reply, row["reward_model"]["ground_truth"], row["extra_info"])["acc"]
            == 0.0
        )
