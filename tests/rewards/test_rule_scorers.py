import json

import pytest

from hybridflow.rewards import RULE_SCORERS, arithmetic, countdown, default_compute_score, gsm8k, math_answer
from hybridflow.utils.errors import UserError


@pytest.mark.parametrize(
    "reply, truth, strict, flexible",
    [
        ("She has 3 + 4 = 7 apples, times 2 is 14.\n#### 14", "14", 1.0, 1.0),
        ("Total: 1,000 + 250.\n#### $1,250.", "1250", 1.0, 1.0),  # compared as numbers
        ("#### 72.0", "72", 1.0, 1.0),
        ("so the answer is 18.", "18", 0.0, 1.0),  # no '####': only the flexible rule finds it
        ("I think 18, no wait, 19", "18", 0.0, 0.0),
        ("#### 15 (I double checked 14)", "14", 0.0, 1.0),  # strict: after '####'; flexible: the last number
        ("#### -3", "-3", 1.0, 1.0),
        ("no idea", "5", 0.0, 0.0),
        ("#### 5" + " filler" * 60, "5", 0.0, 0.0),  # only the last 300 characters are read
    ],
)
def test_gsm8k(reply, truth, strict, flexible):
    assert gsm8k.compute_score(reply, truth) == strict  # verl's default: method="strict"
    assert gsm8k.compute_score(reply, truth, method="flexible") == flexible


@pytest.mark.parametrize(
    "reply, truth, expected",
    [
        ("so $x = \\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\sqrt{2}}", "The side is $\\boxed{\\sqrt{2}}$.", 1.0),  # boxed ground truth
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),
        ("first \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
        ("\\boxed{1/3}", "0.33", 0.0),
        ("the answer is 4", "4", 0.0),  # nothing boxed
        ("\\boxed{4", "4", 0.0),  # unbalanced
    ],
)
def test_math(reply, truth, expected):
    assert math_answer.compute_score(reply, truth) == expected


@pytest.mark.parametrize(
    "reply, score, acc",
    [
        ("86+88=174", 1.0, 1.0),
        ("  86+88=174\n", 1.0, 1.0),
        ("86+88=174. This is the correct answer", 0.5, 1.0),  # right, but chatter after it
        ("86+88 = 174", 0.5, 1.0),
        ("14+27=174", 0.5, 1.0),  # right sum, wrong form
        ("86+88=173", 0.0, 0.0),
        ("86+88=1745", 0.0, 0.0),  # the whole leading integer must be the sum
        ("The answer is 174", 0.0, 0.0),  # no '='
        ("", 0.0, 0.0),
    ],
)
def test_arithmetic(reply, score, acc):
    assert arithmetic.compute_score(reply, "174", {"a": 86, "b": 88}) == {"score": score, "acc": acc}


def test_arithmetic_without_operands_accepts_any_form():
    assert arithmetic.compute_score("1+2=3", "3") == {"score": 1.0, "acc": 1.0}


TRUTH = json.dumps({"target": 120, "numbers": [3, 7, 12]})


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("Let me try. <answer>(3 + 7) * 12</answer>", 1.0),
        ("<answer>12*(7+3) = 120</answer>", 1.0),  # a trailing '= result' is ignored
        ("<answer>1</answer> no, <answer>(7 + 3) * 12</answer>", 1.0),  # the last block counts
        ("<answer>3 + 7 + 12</answer>", 0.1),  # well formed, wrong value
        ("<answer>(3 + 7) * 12 * 1</answer>", 0.1),  # a number not given
        ("<answer>(7 + 7) * 12</answer>", 0.1),  # a number used twice
        ("<answer>12 / (7 - 7) + 3</answer>", 0.1),  # numbers wrong and division by zero
        ("<answer>3 / (7 - 7) * 12</answer>", 0.1),
        ("<answer>-3 + 7 * 12</answer>", 0.0),  # unary minus is not an allowed operation
        ("<answer>3.5 * 7 * 12</answer>", 0.0),
        ("<answer>__import__('os').getcwd()</answer>", 0.0),
        ("<answer>3 ** 7 // 12</answer>", 0.0),
        ("(3 + 7) * 12", 0.0),  # no tags
    ],
)
def test_countdown(reply, expected):
    assert countdown.compute_score(reply, TRUTH) == expected
    assert countdown.compute_score(reply, json.loads(TRUTH)) == expected


def test_countdown_division_exact():
    truth = {"target": 4, "numbers": [2, 6, 3]}
    assert countdown.compute_score("<answer>6 / 3 * 2</answer>", truth) == 1.0
    assert countdown.compute_score("<answer>6 / (3 * 2)</answer>", truth) == 0.1  # 1, not 4


def test_dispatch_by_data_source():
    assert default_compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    assert default_compute_score("DigitalLearningGmbH/MATH-lighteval", "\\boxed{5}", "5") == 1.0
    assert default_compute_score("arithmetic", "1+2=3", "3", {"a": 1, "b": 2}) == {"score": 1.0, "acc": 1.0}
    assert (
        default_compute_score(
            "countdown", "<answer>3 * 7 - 12</answer>", json.dumps({"target": 9, "numbers": [12, 3, 7]})
        )
        == 1.0
    )
    assert {"gsm8k", "math", "lighteval/MATH"} <= set(RULE_SCORERS)
    with pytest.raises(UserError, match=r"data_source 'my/task'; known: \[.*'arithmetic'.*'openai/gsm8k'"):
        default_compute_score("my/task", "x", "y")
