"""verl's reward functions: the data_source names its default_compute_score knows for GSM8K and MATH score
here as they do there, the scorer modules take verl's arguments, and a reward file written for verl
(``compute_score(data_source, solution_str, ground_truth, extra_info)`` returning a number or a dict with
``score``) trains unchanged."""

import pytest
import torch

from hybridflow.models import make_tiny_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import (
    RewardManager,
    default_compute_score,
    gsm8k,
    load_custom_reward_function,
    math_dapo,
)


@pytest.mark.parametrize(
    "source, reply, truth, expected",
    [
        ("openai/gsm8k", "3 + 4 = 7\n#### 7", "7", 1.0),
        ("openai/gsm8k", "the answer is 7", "7", 0.0),  # verl's strict rule: '#### N' is required
        ("gsm8k", "the answer is 7", "7", 1.0),  # the flexible rule
        ("lighteval/MATH", "so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
        ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{3}", "4", 0.0),
        ("HuggingFaceH4/MATH-500", "\\boxed{90^\\circ}", "90", 1.0),
        ("numina_olympiads", "\\boxed{12}", "12", 1.0),
        ("math", "work...\nAnswer: \\frac{1}{2}", "0.5", {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}),
        ("math_dapo", "Answer: 7", "8", {"score": -1.0, "acc": False, "pred": "7"}),
        ("aime2024", "x = 3, so\nAnswer: x = 33", "33", {"score": 1.0, "acc": True, "pred": "33"}),
        ("math_dapo_reasoning", "no answer line", "1", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    ],
)
def test_verls_data_source_names(source, reply, truth, expected):
    assert default_compute_score(source, reply, truth) == expected


def test_scorer_modules_take_verls_arguments():
    assert gsm8k.compute_score("#### 9", "9", method="strict", format_score=0.1, score=2.0) == 2.0
    assert gsm8k.compute_score("#### 8", "9", format_score=0.1) == 0.1  # an answer, but wrong
    assert gsm8k.compute_score("nine", "9", format_score=0.1) == 0.0  # no answer at all
    assert gsm8k.extract_solution("a 1 then 2.5 apples", method="flexible") == "2.5"
    # DAPO's strict box: the last \boxed{} of the last 100 characters, character for character
    assert math_dapo.compute_score("\\boxed{1/2}", "1/2", strict_box_verify=True)["acc"] is True
    assert math_dapo.compute_score("\\boxed{0.5}", "1/2", strict_box_verify=True)["score"] == -1.0
    far = "Answer: 5\n" + "x" * 300
    assert math_dapo.compute_score(far, "5")["pred"] == "[INVALID]"  # only the last 300 characters count


VERL_REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "count":
        return len(solution_str)  # an int
    if data_source == "flag":
        return solution_str == ground_truth  # a bool
    return {"score": 0.5, "acc": 1.0, "note": extra_info["k"]}  # a dict with score and extras
"""


def test_a_verl_reward_file_scores_through_the_reward_manager(tmp_path):
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_REWARD_FILE)
    tok = make_tiny_tokenizer()
    replies = ["abc", "yes", "zz"]
    ids = [tok(r, add_special_tokens=False)["input_ids"] for r in replies]
    width = max(map(len, ids))
    responses = torch.tensor([row + [tok.pad_token_id] * (width - len(row)) for row in ids])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    data = DataProto.from_dict(
        {"responses": responses, "response_mask": mask},
        {
            "data_source": ["count", "flag", "other"],
            "ground_truth": ["", "yes", ""],
            "extra_info": [{}, {}, {"k": 7}],
        },
    )
    out = RewardManager(tok, compute_score=load_custom_reward_function(path))(data, return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [3.0, 1.0, 0.5]
    assert out["reward_extra_info"]["note"] == [None, None, 7]
