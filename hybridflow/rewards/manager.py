"""Turning decoded responses into token-level scores with a rule (or user) reward function."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, overload

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from hybridflow.algorithms import sequence_to_token_scores
from hybridflow.protocol import DataProto
from hybridflow.rewards.registry import BatchScorer, RuleScorers, Score
from hybridflow.utils.errors import InputError, UserError

CONVERSATION_KEYS = ("messages", "tool_calls", "tool_rewards")


def _function_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


SCORE_RULE = "a score is a number (bool, int, float or a 0-d tensor) or a dict with a numeric 'score'"


def _as_score(value: Any, where: str) -> float:
    """``value`` as a finite float when it is a number; text (even ``"1.0"``), None, lists... are refused:
    a scorer that returns them has a bug that a silent conversion would hide."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_complex():
        value = value.item()
    if not isinstance(value, bool | int | float | np.bool_ | np.integer | np.floating):
        raise InputError(f"{where} returned {type(value).__name__} {value!r:.60}: {SCORE_RULE}")
    score = float(value)
    if not math.isfinite(score):
        raise InputError(f"{where} returned the score {score}: a score must be finite")
    return score


def checked_score(result: Any, where: str) -> dict[str, Any]:
    """What a reward function returned, as a dict whose ``"score"`` is a finite float: the one rule for what
    a scorer may return (``SCORE_RULE``), applied by training and by ``hybridflow doctor`` alike, so doctor
    passes exactly the scorers training accepts. Raises ``InputError`` naming ``where``."""
    scored: dict[str, Any] = dict(result) if isinstance(result, dict) else {"score": result}
    if "score" not in scored:
        raise InputError(f"{where} returned a dict without 'score' (keys {sorted(scored)}): {SCORE_RULE}")
    scored["score"] = _as_score(scored["score"], where)
    return scored


class RewardManager:
    """Scores a batch of responses: decode, call `compute_score`, put each score on its last token.

    `compute_score(data_source, solution_str, ground_truth, extra_info)` returns a float or a dict
    with a "score" key (every key of the dict is also collected into `reward_extra_info`, e.g. an
    accuracy to log next to a shaped score). It defaults to the rule scorers (`RuleScorers`); a
    `BatchScorer` gets the whole batch in one call (code rows run in parallel sandboxes). The first
    `num_examine` responses of each data source are printed, to eyeball what the model writes and how it
    is graded.

    Multi-turn rollouts: `solution_str` is every model turn (tool output left out), and `extra_info`
    also holds the conversation: `messages` (the chat, tool results included), `tool_calls` (per turn,
    what the model called) and `tool_rewards` (the sum of the tools' own rewards).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        compute_score: Callable[..., Score] | None = None,
        num_examine: int = 0,
        reward_fn_key: str = "data_source",
    ) -> None:
        self.tokenizer = tokenizer
        self.compute_score = compute_score or RuleScorers()
        self.num_examine = num_examine
        self.reward_fn_key = reward_fn_key

    def response_mask(self, data: DataProto) -> torch.Tensor:
        """`(bs, response_length)` mask of real response tokens: `response_mask`, else the tail of
        `attention_mask` (which spans prompt + response)."""
        if "response_mask" in data.tensors.keys():
            mask: torch.Tensor = data.tensors["response_mask"]
        else:
            mask = data.tensors["attention_mask"][:, -data.tensors["responses"].shape[1] :]
        return mask

    def _score_one(
        self, i: int, data_source: Any, text: str, ground_truth: Any, extra_info: Any
    ) -> dict[str, Any]:
        with self._failures(f"sample {i} (data_source {data_source!r})"):
            result = self.compute_score(data_source, text, ground_truth, extra_info)
        return self._checked(i, data_source, text, result)

    def _checked(self, i: int, data_source: Any, text: str, result: Any) -> dict[str, Any]:
        name = _function_name(self.compute_score)
        where = f"reward function {name} on sample {i} (data_source {data_source!r}, response {text!r:.60})"
        return checked_score(result, where)

    @contextmanager
    def _failures(self, what: str, name_input_errors: bool = True) -> Iterator[None]:
        """A ``UserError`` (e.g. no rule scorer for this data_source: the input is wrong) names ``what``
        (unless ``name_input_errors`` is false: a batch scorer names the sample itself); any other exception
        is the scorer's failure, named with it."""
        try:
            yield
        except UserError as e:
            if not name_input_errors:
                raise
            raise UserError(f"{what}: {e}") from e
        except Exception as e:
            raise RuntimeError(
                f"reward function {_function_name(self.compute_score)} failed on {what}: {type(e).__name__}: {e}"
            ) from e

    def _score_all(
        self, sources: list[Any], texts: list[str], truths: list[Any], infos: list[Any]
    ) -> list[dict[str, Any]]:
        if not isinstance(self.compute_score, BatchScorer):
            return [self._score_one(i, *row) for i, row in enumerate(zip(sources, texts, truths, infos))]
        with self._failures(f"a batch of {len(texts)} samples", name_input_errors=False):
            raw = self.compute_score.score_batch(sources, texts, truths, infos)
        if len(raw) != len(texts):
            raise RuntimeError(
                f"{_function_name(self.compute_score)}.score_batch returned {len(raw)} scores for {len(texts)} samples"
            )
        return [self._checked(i, sources[i], texts[i], result) for i, result in enumerate(raw)]

    @overload
    def __call__(self, data: DataProto, return_dict: Literal[False] = False) -> torch.Tensor: ...

    @overload
    def __call__(self, data: DataProto, return_dict: Literal[True]) -> dict[str, Any]: ...

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        """`token_level_scores` `(bs, response_length)` float32 on the CPU, zero except each row's last
        valid token (column 0 for an empty response, so sequence-level sums still see the score).

        With `return_dict=True`: {"reward_tensor": that tensor, "reward_extra_info": {key: list of bs
        values}} where a sample whose scorer did not return a key has None there.
        """
        columns = data.non_tensor_batch
        for key in (self.reward_fn_key, "ground_truth"):
            if key not in columns:
                raise KeyError(
                    f"RewardManager needs non_tensor_batch[{key!r}]; the batch has {sorted(columns)}"
                )
        responses = data.tensors["responses"].cpu()
        mask = self.response_mask(data).bool().cpu()
        texts = self.tokenizer.batch_decode(
            [row[m].tolist() for row, m in zip(responses, mask)], skip_special_tokens=True
        )
        extra_infos: Sequence[Any] | np.ndarray = columns.get("extra_info", [None] * len(texts))
        if "messages" in columns:
            extra_infos = [
                {**(info or {}), **{k: columns[k][i] for k in CONVERSATION_KEYS if k in columns}}
                for i, info in enumerate(extra_infos)
            ]
        results = self._score_all(
            list(columns[self.reward_fn_key]), texts, list(columns["ground_truth"]), list(extra_infos)
        )
        scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)
        reward = sequence_to_token_scores(scores, mask.cpu())
        self._print_examples(data, texts, results)
        if not return_dict:
            return reward
        keys = dict.fromkeys(k for r in results for k in r)
        return {"reward_tensor": reward, "reward_extra_info": {k: [r.get(k) for r in results] for k in keys}}

    def _print_examples(self, data: DataProto, texts: list[str], results: list[dict[str, Any]]) -> None:
        """Print the first `num_examine` (prompt,) response, ground truth and score of each data source."""
        shown: dict[Any, int] = defaultdict(int)
        columns = data.non_tensor_batch
        for i, (text, result) in enumerate(zip(texts, results)):
            source = columns[self.reward_fn_key][i]
            if shown[source] >= self.num_examine:
                continue
            shown[source] += 1
            if "raw_prompt" in columns:
                print(f"[reward {source} #{i}] prompt: {columns['raw_prompt'][i]!r}")
            print(f"[reward {source} #{i}] response: {text!r}")
            print(f"[reward {source} #{i}] ground truth: {columns['ground_truth'][i]!r} -> {result}")
