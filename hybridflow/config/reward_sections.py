"""The PPO config's reward sections (``reward_model``, ``custom_reward_function``): what scores the responses,
a learned reward model, a judge, code run against its tests, and the shaping every score gets. Part of the
schema (``schema.py`` assembles the root); the same ``#:`` docs generate the shipped YAML."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class RewardModelPathConfig:
    """Where a learned reward model lives and which tokenizer its inputs are re-templated with."""

    path: str | None = None  #: the reward model folder or hub id
    input_tokenizer: str | None = None  #: tokenizer to re-template inputs with; null = the reward model's own


@dataclass
class TwoStageRewardConfig:
    """Score everything with the cheap reward, then only the top share with the reward model."""

    enable: bool = False  #: turn two-stage scoring on (needs reward_model.enable)
    top_k_ratio: float = 0.3  #: share of responses per batch sent to the reward model
    threshold: float | None = None  #: alternatively, send responses whose cheap score is >= threshold
    unselected: Literal["keep", "scale", "zero"] = "keep"  #: reward of the others: keep | scale | zero
    unselected_scale: float = 1.0  #: factor for unselected: scale


@dataclass
class CodeRewardConfig:
    """Code scored by running it against its tests (data_source code, humaneval, mbpp, apps, taco...), one
    sandbox per sample (the python tool's; hybridflow extension, verl's sandbox_fusion names where they fit)."""

    #: sandboxes running at once; null = 4 per CPU core (a sandbox mostly waits on process start and teardown)
    max_concurrent: int | None = None
    memory_limit_mb: int = 1024  #: address-space limit of a sample's sandbox, in MB
    sample_timeout_s: float = (
        10.0  #: wall-clock limit of one sample, all its tests together (the rest then fail)
    )
    test_timeout_s: float = 3.0  #: wall-clock (and, rounded up, CPU) limit of one test
    #: all_or_nothing = 1 only when every test passes; fraction = the share of tests passed
    score: Literal["all_or_nothing", "fraction"] = "all_or_nothing"


DEFAULT_JUDGE_TEMPLATE = (
    "Grade the answer to the question. Question: {prompt} Reference answer: {ground_truth} Answer: {response} "
    "How correct is the answer, from 0 (wrong) to 10 (fully correct)? Reply with the number only."
)


@dataclass
class JudgeConfig:
    """A judge model that scores responses (reward_model.style=generative): the causal LM at
    reward_model.model.path in the reward model's worker, or an OpenAI-compatible endpoint (hybridflow extension)."""

    #: an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (hybridflow serve's default, on loopback);
    #: null = the causal LM at reward_model.model.path, in the reward model's worker
    base_url: str | None = None
    model: str | None = None  #: the model name sent to the endpoint; null = the first its /models lists
    api_key_env: str = "OPENAI_API_KEY"  #: environment variable with the endpoint's key (sent when set)
    #: the judge's user message; {prompt} (the last user message), {response} and {ground_truth} are filled in
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    #: number (the first number, on score_range) | verdict (yes_words 1, no_words 0) | yes_probability (of the
    #: first yes word's token as the reply's first token)
    parser: Literal["number", "verdict", "yes_probability"] = "number"
    score_range: list[float] = field(default_factory=lambda: [0.0, 10.0])  #: number: [low, high] -> [0, 1]
    yes_words: list[str] = field(default_factory=lambda: ["yes", "correct"])  #: verdict words that score 1
    no_words: list[str] = field(
        default_factory=lambda: ["no", "incorrect", "wrong"]
    )  #: verdict words that score 0
    max_tokens: int = 16  #: tokens the judge may write (yes_probability reads only the first)
    micro_batch_size_per_gpu: int = 8  #: prompts per generation of the worker's judge
    max_concurrent: int = 8  #: endpoint calls in flight at once
    request_timeout_s: float = 60.0  #: seconds per endpoint call
    failure_score: float = (
        0.0  #: the score of a failed call or an unparsable verdict (counted in reward/judge/failures)
    )


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: a penalty growing linearly over the last ``len`` tokens of
    data.max_response_length, from 0 to -penalty_factor (added to each sample's score)."""

    enable: bool = False  #: add the penalty to the scores
    len: int = 0  #: the buffer: tokens before data.max_response_length where the penalty starts
    penalty_factor: float = 1.0  #: the penalty at data.max_response_length tokens


@dataclass
class RewardModelConfig:
    """A learned reward model (off by default: rule-based rewards come from the reward manager)."""

    enable: bool = False  #: score responses with a learned reward model
    #: discriminative = a sequence classifier's scalar; generative = a judge model's parsed verdict (judge.*)
    style: Literal["discriminative", "generative"] = "discriminative"
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)  #: the reward model
    micro_batch_size_per_gpu: int = 8  #: sequences per reward-model forward on one worker
    #: what the reward model reads: chat (the conversation in its tokenizer's chat template), plain (the prompt
    #: text, a newline, the response: for classifiers without a template), auto (chat when it has a template)
    input_format: Literal["auto", "chat", "plain"] = "auto"
    #: a stand-in reward model for smoke runs: loads nothing, scores each response by its length and the
    #: share of distinct tokens in it (in [0, 1], so rewards move as the responses change)
    dummy: bool = False
    #: cheap reward for all, reward model only for the best share (hybridflow extension)
    two_stage: TwoStageRewardConfig = field(default_factory=TwoStageRewardConfig)
    #: how code rows are run and scored (the rule scorer of the code data sources)
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)  #: the judge of style generative
    #: the reward is model_weight x the reward model's (or judge's) score + rule_weight x the rule scorer's
    model_weight: float = 1.0
    #: weight of the rule (or custom) scorer in that sum; 0 = the model's score alone (reward_model.two_stage
    #: instead: the rule ranks, the model re-scores the best)
    rule_weight: float = 0.0
    #: DAPO's overlong reward shaping (applies to every scorer, not only a reward model)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class CustomRewardFunctionConfig:
    """A user reward function ``name`` in the Python file ``path``."""

    path: str | None = None  #: Python file with your reward function; null = the built-in scorers
    name: str = "compute_score"  #: function name in that file
