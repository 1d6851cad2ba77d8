"""The served rollout: agents written with the ``openai`` SDK generate the training batch.

``generate_sequences`` (the rollout contract, so the trainer's step is unchanged) starts a ``PolicyServer``
over the worker's rollout engine once, then runs the user's ``async def run(client, sample) -> float | dict``
for ``n`` sessions per prompt, all at once, each with a client whose base URL names its session. ``sample``
is the prompt's data row exactly as the file holds it (every column, nested as written) plus ``messages``,
the prompt as chat messages; each session gets a copy of its own.

The batch comes from what the server sampled for each session (``sessions.sequences``): calls that continue
each other token for token form one row with the tokens between them masked out of ``response_mask``, other
calls rows of their own. The agent's return value is the session's reward, checked by the one rule for what
a scorer may return (``checked_score``); the rollout attaches it to every row of the session itself
(``attach_scores``), so the trainer calls no reward function for a served agent. The trainer's sampling
(``temperature``, ``top_p``, greedy for validation) applies to calls that do not set their own.

An agent that raises stops the run with one line naming the agent, the exception, the step and the sample's
keys; with ``served_agent.on_error=score_zero`` the session scores 0 instead (the rows of the calls it made
train with that reward) and is counted in ``served/failed_sessions``.
A vision-language policy's agent also gets ``image_urls``: the row's pictures as ``data:`` URLs, to send as
``image_url`` parts; the policy then trains on the images its calls sent.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from hybridflow.config import RolloutConfig
from hybridflow.config.checks import required
from hybridflow.data.dataset import left_pad
from hybridflow.data.images import ImagePrompts, data_url
from hybridflow.models.vision import IMAGES
from hybridflow.protocol import DataProto
from hybridflow.rewards.manager import checked_score
from hybridflow.rollout import Capabilities, Rollout, attach_responses, attach_scores
from hybridflow.serving.sessions import Sequence, sequences
from hybridflow.utils.errors import InputError, UserError
from hybridflow.utils.user_code import load_user_function

logger = logging.getLogger(__name__)
AGENT_KEY = "actor_rollout_ref.rollout.served_agent"
Outcome = tuple[float, dict[str, Any], bool]  # a session's score, the agent's other values, whether it failed


class AgentError(UserError):
    """The user's agent raised in a session: the run stops with this one line."""


def agent_sample(rows: DataProto, i: int) -> dict[str, Any]:
    """What the agent gets for row ``i``: a copy of its data row as the file holds it (``data_row``; a batch
    built in code without one: its non-tensor columns) plus ``messages``, the prompt as chat messages, and
    ``image_urls``, its pictures as ``data:`` URLs (a vision-language policy's rows)."""
    columns = rows.non_tensor_batch
    row = columns["data_row"][i] if "data_row" in columns else {k: v[i] for k, v in columns.items()}
    sample = copy.deepcopy(dict(row))
    if "raw_prompt" in columns:
        sample["messages"] = copy.deepcopy(list(columns["raw_prompt"][i]))
    if IMAGES in columns and len(columns[IMAGES][i]):
        sample["image_urls"] = [data_url(image) for image in columns[IMAGES][i]]
    return sample


class ServedRollout(Rollout):
    """``generate_sequences`` by the user's agent over an OpenAI-compatible server on ``engine``.

    ``config``: the rollout section (its ``served_agent`` section names the agent and the server's settings);
    ``weight_version``: the version of the weights the engine samples from (the actor's update count). A
    rollout mode: reseeding and the weights go to the engine; it does not follow weights while it generates
    (the engine behind the server generates whole samples)."""

    def __init__(
        self,
        engine: Rollout,
        tokenizer: PreTrainedTokenizerBase,
        config: RolloutConfig,
        response_length: int,
        weight_version: Callable[[], int] = lambda: 0,
        processor: ImagePrompts | None = None,
    ) -> None:
        served_agent = config.served_agent
        agent_path = required(served_agent.path, f"{AGENT_KEY}.path")  # build_rollout only builds it with one
        self.run = load_user_function(agent_path, served_agent.name, AGENT_KEY, what="agent file")
        if not inspect.iscoroutinefunction(self.run):
            raise InputError(
                f"{AGENT_KEY}.name: {served_agent.name!r} in {served_agent.path} must be an async function"
            )
        self.agent, self.on_error = f"{served_agent.name!r} ({served_agent.path})", served_agent.on_error
        self.engine, self.tokenizer, self.response_length = engine, tokenizer, response_length
        self.eos_token_ids = list(engine.eos_token_ids)
        self.capabilities = Capabilities(own_weights=engine.capabilities.own_weights)
        # aiohttp is loaded only where a rollout serves (see the package's __getattr__)
        from hybridflow.serving.server import PolicyServer

        self.server = PolicyServer(
            engine,
            tokenizer,
            served_agent.model_name,
            max_tokens_limit=response_length,
            window_s=served_agent.batch_window_ms / 1000,
            weight_version=weight_version,
            processor=processor,
        )
        self.sampling = config  # the trainer's sampling, for calls that set none
        self._started = False

    def reseed(self, step: int) -> None:
        """The engine's: the sessions of a step draw on from it."""
        self.engine.reseed(step)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """The engine's (an engine with weights of its own still gets every update)."""
        return self.engine.update_weights(weights)

    def close(self) -> None:
        """Stop the server (started by the first generation)."""
        if self._started:
            self.server.stop_thread()
            self._started = False

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """In: the prompt batch (``raw_prompt``, ``data_row`` and the data columns); ``meta_info`` ``n``,
        sampling, ``global_step``. Out: one row per sample the sessions produced (see the module's docstring),
        the input's columns copied to each, ``rm_scores`` and ``reward_extra/*`` (the sessions' rewards) and
        ``session_samples``; ``meta_info["metrics"]``."""
        if not self._started:
            self.server.start_in_thread()
            self._started = True
        rows = prompts.repeat(int(prompts.meta_info.get("n", 1)), interleave=True)
        meta = prompts.meta_info
        greedy = meta.get("do_sample", self.sampling.do_sample) is False
        self.server.default_sampling = {
            "temperature": 0.0 if greedy else meta.get("temperature", self.sampling.temperature),
            "top_p": meta.get("top_p", self.sampling.top_p),
        }
        samples = [agent_sample(rows, i) for i in range(len(rows))]
        names = [f"s{uuid.uuid4().hex[:12]}" for _ in samples]
        # the step as the logs number it (the batch generated at global_step 0 is logged as step 1)
        when = f"step {meta['global_step'] + 1}" if "global_step" in meta else "a generation outside training"
        batches_before = len(self.server.batcher.batch_sizes)
        try:
            outcomes = asyncio.run(self._sessions(names, samples, when))
        finally:  # the server forgets the sessions, also those of a batch an agent's error stopped
            per_session = [sequences(self.server.take_session(name).records) for name in names]
        sizes = self.server.batcher.batch_sizes[batches_before:]
        out = self._to_batch(rows, per_session, outcomes)
        out.meta_info["metrics"] = self._metrics(per_session, sizes, outcomes)
        return out

    async def _sessions(self, names: list[str], samples: list[dict], when: str) -> list[Outcome]:
        try:
            import openai
        except ImportError as err:
            raise InputError(
                f"{AGENT_KEY} hands each agent an openai.AsyncOpenAI client: pip install openai"
            ) from err

        # one connection pool for every session: connections are reused instead of opened per session, and
        # a busy machine's slow accepts get a long connect timeout rather than failing the step
        http = openai.DefaultAsyncHttpxClient(timeout=openai.Timeout(600.0, connect=120.0))

        async def one(name: str, sample: dict) -> Outcome:
            """One session: the agent on its own client, its return value checked by the rule for scores."""
            client = openai.AsyncOpenAI(
                base_url=self.server.session_url(name), api_key="unused", max_retries=0, http_client=http
            )
            keys = sorted(sample)
            try:
                value = await self.run(client, sample)
            except Exception as error:  # noqa: BLE001 - the user's agent: one line, or a zero score
                return self._failed(error, when, keys)
            result = checked_score(value, f"the agent {self.agent} (session {name}, {when})")
            return result.pop("score"), result, False

        try:
            return list(await asyncio.gather(*(one(n, s) for n, s in zip(names, samples))))
        finally:
            await http.aclose()

    def _failed(self, error: Exception, when: str, keys: list[str]) -> Outcome:
        line = (
            f"the agent {self.agent} raised {type(error).__name__}: {error} in a session of {when} "
            f"(the sample's keys: {', '.join(keys)})"
        )
        if self.on_error == "stop":
            raise AgentError(f"{line}; fix the agent, or set {AGENT_KEY}.on_error=score_zero") from error
        logger.warning("%s: the session scores 0 (%s.on_error=score_zero)", line, AGENT_KEY)
        return 0.0, {}, True

    def _to_batch(
        self, rows: DataProto, per_session: list[list[Sequence]], outcomes: list[Outcome]
    ) -> DataProto:
        owners = [i for i, seqs in enumerate(per_session) for _ in seqs]
        flat = [s for seqs in per_session for s in seqs]
        if not flat:
            raise InputError(f"no agent session made a call to the server ({AGENT_KEY}): nothing to train on")
        width, length = max(len(s.prompt_ids) for s in flat), self.response_length
        pad = self.tokenizer.pad_token_id
        prompt_rows = [left_pad(s.prompt_ids, width, pad) for s in flat]
        responses = torch.full((len(flat), length), pad, dtype=torch.long)
        mask, attended = torch.zeros_like(responses), torch.zeros_like(responses)
        log_probs = torch.zeros(len(flat), length)
        for r, s in enumerate(flat):
            k = min(len(s.ids), length)
            responses[r, :k] = torch.tensor(s.ids[:k], dtype=torch.long)
            mask[r, :k] = torch.tensor(s.mask[:k], dtype=torch.long)
            attended[r, :k] = 1
            log_probs[r, :k] = torch.tensor(s.log_probs[:k])
        columns = dict(rows[owners].non_tensor_batch)
        columns["session_samples"] = np.array([len(per_session[i]) for i in owners], dtype=object)
        columns.pop(IMAGES, None)  # a row's images are those its calls sent, not its data row's
        if any(s.images for s in flat):
            columns[IMAGES] = np.empty(len(flat), dtype=object)
            for r, s in enumerate(flat):
                columns[IMAGES][r] = s.images
        out = DataProto.from_dict(
            {k: torch.stack([p[k] for p in prompt_rows]) for k in prompt_rows[0]}, columns
        )
        out = attach_responses(out, responses, mask, log_probs, attended=attended)
        return attach_scores(out, [outcomes[i][0] for i in owners], [outcomes[i][1] for i in owners])

    def _metrics(
        self, per_session: list[list[Sequence]], batch_sizes: list[int], outcomes: list[Outcome]
    ) -> dict[str, float]:
        """``served/joined_calls``: share of calls that continued an earlier call of their session (one row);
        ``served/samples_per_session``; ``served/truncated``: rows cut at the response budget;
        ``served/failed_sessions``: share of sessions whose agent raised (scored 0); the engine's batch
        sizes."""
        flat = [s for seqs in per_session for s in seqs]
        calls, sessions = sum(s.calls for s in flat), max(len(per_session), 1)
        return {
            "served/calls_per_session": calls / sessions,
            "served/joined_calls": (calls - len(flat)) / max(calls, 1),
            "served/samples_per_session": len(flat) / sessions,
            "served/truncated": sum(len(s.ids) > self.response_length for s in flat) / max(len(flat), 1),
            "served/failed_sessions": sum(failed for _, _, failed in outcomes) / sessions,
            "served/engine_calls": float(len(batch_sizes)),
            "served/batch_rows/mean": float(np.mean(batch_sizes)) if batch_sizes else 0.0,
            "served/batch_rows/max": float(max(batch_sizes, default=0)),
        }
