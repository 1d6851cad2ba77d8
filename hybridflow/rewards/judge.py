"""A judge model's reward: its prompt, the parsers of its verdicts, and calls to an OpenAI-compatible endpoint.

``reward_model.style=generative`` scores each response by asking a judge (a causal LM in the reward model's
worker, or any endpoint that speaks OpenAI's chat API: ``reward_model.judge.base_url``, such as
``hybridflow serve`` of another checkpoint). The judge reads ``judge.prompt_template`` with ``{prompt}`` (the
conversation's last user message), ``{response}`` and ``{ground_truth}`` filled in; its reply is parsed by
``judge.parser``:
- ``number``: the first number in the reply, on ``judge.score_range`` ``[low, high]``, mapped to ``[0, 1]``
  (``(x - low) / (high - low)``); a number outside the range is unparsable;
- ``verdict``: the first of ``judge.yes_words`` (1) or ``judge.no_words`` (0) in the reply, whole words,
  case aside;
- ``yes_probability``: the probability of the first yes word's token as the reply's first token, from the
  model's own distribution (the worker's judge: ``p(yes) / (p(yes) + p(no))`` over the two tokens; an
  endpoint: the greedy token's log-prob, ``p`` when it is the yes token, ``1 - p`` when it is the no token).

The failure rule: a call that fails (an error, a timeout, an HTTP error) or a reply that does not parse
scores ``judge.failure_score`` (0 by default) and counts in ``reward/judge/failures``; the run goes on. Each
verdict's raw text is kept (``judge_verdict``) for the report's samples.
"""

from __future__ import annotations

import json
import math
import os
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hybridflow.config.checks import required
from hybridflow.config.schema import JudgeConfig
from hybridflow.utils.errors import UserError

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class Verdict:
    """One judged sample: its score (``failure_score`` when ``failed``) and what the judge wrote (or why it
    failed)."""

    score: float
    text: str
    failed: bool = False


def render(template: str, prompt: str, response: str, ground_truth: Any) -> str:
    """The template with its placeholders filled (other braces left as they are)."""
    truth = "" if ground_truth is None else str(ground_truth)
    return (
        template.replace("{prompt}", prompt).replace("{ground_truth}", truth).replace("{response}", response)
    )


def last_user_message(messages: Any) -> str:
    """What ``{prompt}`` shows: the conversation's last user message (the question the response answers)."""
    if isinstance(messages, str):
        return messages
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return users[-1] if users else ""


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def parse_verdict(text: str, config: JudgeConfig) -> float | None:
    """The parser ``number`` or ``verdict`` on one reply: a score in [0, 1], or None (unparsable)."""
    if config.parser == "number":
        match = _NUMBER.search(text)
        low, high = config.score_range
        if match is None or not low <= float(match.group()) <= high:
            return None
        return (float(match.group()) - low) / (high - low)
    yes, no = {w.lower() for w in config.yes_words}, {w.lower() for w in config.no_words}
    for word in _words(text):
        if word in yes:
            return 1.0
        if word in no:
            return 0.0
    return None


def yes_probability(token: str, logprob: float, config: JudgeConfig) -> float | None:
    """``yes_probability`` from an endpoint's greedy first token and its log-prob (see the module docstring).
    The token is the yes (no) word's when it begins that word and not the other: the first token of a word
    may be a piece of it (``y`` of ``yes``)."""
    piece = token.strip().lower()
    yes, no = config.yes_words[0].lower(), config.no_words[0].lower()
    is_yes, is_no = bool(piece) and yes.startswith(piece), bool(piece) and no.startswith(piece)
    if is_yes == is_no:
        return None
    return math.exp(logprob) if is_yes else 1.0 - math.exp(logprob)


class EndpointJudge:
    """Asks an OpenAI-compatible chat endpoint, ``judge.max_concurrent`` calls in flight at once (a serving
    engine batches what arrives together). Standard library HTTP: nothing more to install."""

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        self.base_url = required(config.base_url, "reward_model.judge.base_url").rstrip("/")
        self.key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        self._model = config.model

    def _request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        request = urllib.request.Request(f"{self.base_url}{path}", data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=self.config.request_timeout_s) as answer:
            reply = json.loads(answer.read())
        if not isinstance(reply, dict):
            raise ValueError(
                f"the judge endpoint {self.base_url}{path} answered {reply!r:.120}, not a JSON object"
            )
        return reply

    def model(self) -> str:
        """``judge.model``, else the first model the endpoint lists (``GET /models``), asked once."""
        if self._model is None:
            try:
                self._model = self._request("/models")["data"][0]["id"]
            except (OSError, ValueError, KeyError, IndexError) as err:
                raise UserError(
                    f"reward_model.judge.base_url={self.config.base_url}: cannot list its models ({err}); "
                    "is the endpoint up? (or set reward_model.judge.model)"
                ) from None
        return self._model

    def _ask(self, content: str) -> Verdict:
        c = self.config
        body = {
            "model": self.model(),
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 1 if c.parser == "yes_probability" else c.max_tokens,
            "temperature": 0.0,
        }
        if c.parser == "yes_probability":
            body["logprobs"] = True
        try:
            choice = self._request("/chat/completions", body)["choices"][0]
            text = choice["message"]["content"] or ""
            if c.parser == "yes_probability":
                first = choice["logprobs"]["content"][0]
                score = yes_probability(first["token"], first["logprob"], c)
            else:
                score = parse_verdict(text, c)
        except urllib.error.HTTPError as err:
            return Verdict(c.failure_score, f"HTTP {err.code}: {err.read()[:200]!r}", failed=True)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
            return Verdict(c.failure_score, f"{type(err).__name__}: {err}", failed=True)
        if score is None:
            return Verdict(c.failure_score, text, failed=True)
        return Verdict(score, text)

    def judge(self, contents: Sequence[str]) -> list[Verdict]:
        """One verdict per rendered prompt, in order."""
        self.model()  # once, before the calls fan out
        judge = self.config
        with ThreadPoolExecutor(max(1, min(judge.max_concurrent, len(contents)))) as pool:
            return list(pool.map(self._ask, contents))
