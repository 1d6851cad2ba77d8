import math

import pytest
import torch

from hybridflow.models import make_tiny_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardManager, load_custom_reward_function
from hybridflow.utils.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def batch(tok, replies, sources, truths, extra=None, length=12, mask_key="response_mask"):
    """Right-padded responses, each ending in eos, as the rollout returns them."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    rows, masks = [], []
    for reply in replies:
        ids = tok(reply, add_special_tokens=False)["input_ids"] + [eos]
        assert len(ids) <= length
        rows.append(ids + [pad] * (length - len(ids)))
        masks.append([1] * len(ids) + [0] * (length - len(ids)))
    responses, mask = torch.tensor(rows), torch.tensor(masks)
    if mask_key == "attention_mask":  # prompt columns first, as in a full sequence
        mask = torch.cat([torch.ones(len(rows), 3, dtype=torch.long), mask], dim=1)
    non_tensors = {"data_source": sources, "ground_truth": truths}
    if extra is not None:
        non_tensors["extra_info"] = extra
    return DataProto.from_dict({"responses": responses, mask_key: mask}, non_tensors)


def test_score_sits_on_last_valid_token(tok):
    replies = ["86+88=174", "86+88=174 yes", "#### 12"]
    data = batch(
        tok,
        replies,
        ["arithmetic", "arithmetic", "openai/gsm8k"],
        ["174", "174", "13"],
        [{"a": 86, "b": 88}, {"a": 86, "b": 88}, {}],
    )
    out = RewardManager(tok)(data, return_dict=True)
    reward = out["reward_tensor"]
    assert reward.shape == (3, 12) and reward.dtype == torch.float32
    lengths = [len(tok(r)["input_ids"]) + 1 for r in replies]  # + the eos token
    expected = torch.zeros(3, 12)
    expected[0, lengths[0] - 1] = 1.0
    expected[1, lengths[1] - 1] = 0.5
    assert torch.equal(reward, expected)  # row 2 scores 0 everywhere
    assert out["reward_extra_info"] == {"score": [1.0, 0.5, 0.0], "acc": [1.0, 1.0, None]}


def test_hand_built_mask_and_attention_mask_fallback(tok):
    ids = tok("1+2=3", add_special_tokens=False)["input_ids"]
    responses = torch.tensor([ids + [0] * (8 - len(ids))])
    mask = torch.tensor([[1] * len(ids) + [0] * (8 - len(ids))])
    data = DataProto.from_dict(
        {"responses": responses, "response_mask": mask},
        {"data_source": ["arithmetic"], "ground_truth": ["3"]},
    )
    reward = RewardManager(tok)(data)
    assert reward[0].tolist() == [1.0 if j == len(ids) - 1 else 0.0 for j in range(8)]

    via_attention = batch(tok, ["1+2=3"], ["arithmetic"], ["3"], length=8, mask_key="attention_mask")
    assert torch.equal(RewardManager(tok)(via_attention), reward.roll(1, dims=1))  # + the eos token


def test_custom_function_from_file(tmp_path, tok):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def length_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': len(solution_str) / 10, 'source_ok': data_source == 'mine'}\n"
        "def helper():\n    pass\n"
    )
    fn = load_custom_reward_function(f, "length_reward")
    data = batch(tok, ["abcd", "ab"], ["mine", "other"], ["", ""])
    out = RewardManager(tok, compute_score=fn)(data, return_dict=True)
    assert out["reward_tensor"].sum(dim=1).tolist() == pytest.approx([0.4, 0.2])
    assert out["reward_extra_info"]["source_ok"] == [True, False]

    with pytest.raises(
        UserError,
        match=r"my_reward.py has no function 'compute_score'; it defines \['helper', "
        r"'length_reward'\]",
    ):
        load_custom_reward_function(f)
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_custom_reward_function(tmp_path / "missing.py")


def test_raising_function_names_sample_source_and_function(tok):
    def picky_score(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "boom":
            raise KeyError("no such key")
        return 1.0

    data = batch(tok, ["a", "b", "c"], ["s0", "s1", "s2"], ["ok", "boom", "ok"])
    with pytest.raises(
        RuntimeError, match=r"picky_score failed on sample 1 \(data_source 's1'\): KeyError"
    ) as err:
        RewardManager(tok, compute_score=picky_score)(data)
    assert isinstance(err.value.__cause__, KeyError)

    with pytest.raises(UserError, match=r"sample 0 \(data_source 'unknown/src'\): no rule reward"):
        RewardManager(tok)(batch(tok, ["a"], ["unknown/src"], ["x"]))


def test_non_finite_score_and_missing_columns(tok):
    def nan_score(data_source, solution_str, ground_truth, extra_info=None):
        return math.nan if solution_str == "b" else 0.0

    with pytest.raises(ValueError, match=r"nan_score on sample 1 .* returned the score nan"):
        RewardManager(tok, compute_score=nan_score)(batch(tok, ["a", "b"], ["x", "x"], ["", ""]))
    data = DataProto.from_dict(
        {
            "responses": torch.zeros(1, 2, dtype=torch.long),
            "response_mask": torch.ones(1, 2, dtype=torch.long),
        },
        {"data_source": ["x"]},
    )
    with pytest.raises(KeyError, match=r"needs non_tensor_batch\['ground_truth'\]"):
        RewardManager(tok, compute_score=nan_score)(data)


def test_num_examine_prints_per_data_source(tok, capsys):
    data = batch(tok, ["1+2=3", "1+2=4", "#### 5"], ["arithmetic", "arithmetic", "gsm8k"], ["3", "3", "5"])
    RewardManager(tok, num_examine=1)(data)
    printed = capsys.readouterr().out
    assert "[reward arithmetic #0] response: '1+2=3'" in printed
    assert "#1]" not in printed  # only one per data source
    assert "[reward gsm8k #2] ground truth: '5' -> {'score': 1.0}" in printed
