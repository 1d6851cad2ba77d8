"""The served rollout: agents written with the ``openai`` SDK generate the training batch.

``generate_sequences`` (the rollout contract, so the trainer's step is unchanged) starts a
``PolicyServer`` over the worker's rollout engine once, then runs the user's
``async def run(client, sample) -> float | dict`` for ``n`` sessions per prompt, all at once, each with
a client whose base URL names its session (``sample["images"]``: the row's pictures as ``data:`` URLs, for
``image_url`` parts; a vision-language policy then trains on the images its calls sent). The batch comes from what the server sampled for each
session (``sessions.sequences``): calls that continue each other token for token form one row with the
tokens between them masked out of ``response_mask``, other calls rows of their own; every row of a
session carries the session's reward (``agent_reward``), which ``SessionRewards`` puts on its last token.
The trainer's sampling (``temperature``, ``top_p``, greedy for validation) applies to calls that do not
set their own.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from hybridflow.data.dataset import left_pad
from hybridflow.data.images import ImagePrompts, data_url
from hybridflow.models.vision import IMAGES
from hybridflow.protocol import DataProto
from hybridflow.rewards import load_custom_reward_function
from hybridflow.serving.server import PolicyServer
from hybridflow.serving.sessions import Sequence, sequences
from hybridflow.utils.errors import InputError
from hybridflow.workers.rollout.hf_rollout import attach_responses

AGENT_KEY = "actor_rollout_ref.rollout.served_agent"


def _reward(value: Any, where: str) -> tuple[float, dict[str, Any]]:
    """A session's result as (score, extra values): a number, or a dict with a numeric ``score``."""
    extra = dict(value) if isinstance(value, dict) else {}
    score = extra.pop("score", None) if isinstance(value, dict) else value
    if isinstance(score, torch.Tensor) and score.ndim == 0:
        score = score.item()
    if isinstance(score, bool) or not isinstance(score, int | float | np.integer | np.floating):
        raise InputError(f"{where} returned {value!r:.80}: return a number or a dict with a numeric 'score'")
    if not math.isfinite(float(score)):
        raise InputError(f"{where} returned the score {score}: a score must be finite")
    return float(score), extra


class ServedRollout:
    """``generate_sequences`` by the user's agent over an OpenAI-compatible server on ``engine``.

    ``config``: the ``RolloutConfig`` (its ``served_agent`` section names the agent); ``weight_version``:
    the version of the weights the engine samples from (the actor's update count)."""

    def __init__(
        self,
        engine: Any,
        tokenizer: PreTrainedTokenizerBase,
        config: Any,
        response_length: int,
        weight_version: Callable[[], int] = lambda: 0,
        processor: ImagePrompts | None = None,
    ) -> None:
        served_agent = config.served_agent
        self.run = load_custom_reward_function(served_agent.path, served_agent.name, key=AGENT_KEY)
        if not asyncio.iscoroutinefunction(self.run):
            raise InputError(
                f"{AGENT_KEY}.name: {served_agent.name!r} in {served_agent.path} must be an async function"
            )
        self.engine, self.tokenizer, self.response_length = engine, tokenizer, response_length
        self.eos_token_ids = list(getattr(engine, "eos_token_ids", None) or [tokenizer.eos_token_id])
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

    def close(self) -> None:
        if self._started:
            self.server.stop_thread()
            self._started = False

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """In: the prompt batch (``raw_prompt`` and the data columns); ``meta_info`` ``n`` and sampling.
        Out: one row per sample the sessions produced (see the module's docstring), the input's columns
        copied to each, plus ``agent_reward``, ``agent_extra`` and ``session``; ``meta_info["metrics"]``."""
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
        samples = [
            {
                **{k: v[i] for k, v in rows.non_tensor_batch.items()},
                "messages": list(rows.non_tensor_batch["raw_prompt"][i]),
            }
            if "raw_prompt" in rows.non_tensor_batch
            else {k: v[i] for k, v in rows.non_tensor_batch.items()}
            for i in range(len(rows))
        ]
        for sample in samples:  # the row's pictures as the agent sends them: image_url parts
            sample["images"] = [data_url(image) for image in sample.pop(IMAGES, ())]
        names = [f"s{uuid.uuid4().hex[:12]}" for _ in samples]
        batches_before = len(self.server.batcher.batch_sizes)
        results = asyncio.run(self._sessions(names, samples))
        per_session = [sequences(self.server.take_session(name).records) for name in names]
        sizes = self.server.batcher.batch_sizes[batches_before:]
        out = self._to_batch(rows, per_session, results)
        out.meta_info["metrics"] = self._metrics(per_session, sizes)
        return out

    async def _sessions(self, names: list[str], samples: list[dict]) -> list[tuple[float, dict]]:
        try:
            import openai
        except ImportError as err:
            raise InputError(
                f"{AGENT_KEY} hands each agent an openai.AsyncOpenAI client: pip install openai"
            ) from err

        # one connection pool for every session: connections are reused instead of opened per session, and
        # a busy machine's slow accepts get a long connect timeout rather than failing the step
        http = openai.DefaultAsyncHttpxClient(timeout=openai.Timeout(600.0, connect=120.0))

        async def one(name: str, sample: dict) -> tuple[float, dict]:
            client = openai.AsyncOpenAI(
                base_url=self.server.session_url(name), api_key="unused", max_retries=0, http_client=http
            )
            value = await self.run(client, sample)
            return _reward(value, f"the agent {getattr(self.run, '__name__', self.run)!r} (session {name})")

        try:
            return list(await asyncio.gather(*(one(n, s) for n, s in zip(names, samples))))
        finally:
            await http.aclose()

    def _to_batch(
        self, rows: DataProto, per_session: list[list[Sequence]], results: list[tuple[float, dict]]
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
        source = rows[owners]
        columns = dict(source.non_tensor_batch)
        columns["agent_reward"] = np.array([results[i][0] for i in owners], dtype=object)
        columns["agent_extra"] = np.empty(len(flat), dtype=object)
        for r, i in enumerate(owners):
            columns["agent_extra"][r] = results[i][1]
        columns["session_samples"] = np.array([len(per_session[i]) for i in owners], dtype=object)
        columns.pop(IMAGES, None)  # a row's images are those its calls sent, not its data row's
        if any(s.images for s in flat):
            columns[IMAGES] = np.empty(len(flat), dtype=object)
            for r, s in enumerate(flat):
                columns[IMAGES][r] = s.images
        out = DataProto.from_dict(
            {k: torch.stack([p[k] for p in prompt_rows]) for k in prompt_rows[0]}, columns
        )
        return attach_responses(out, responses, mask, log_probs, attended=attended)

    def _metrics(self, per_session: list[list[Sequence]], batch_sizes: list[int]) -> dict[str, float]:
        """``served/joined_calls``: share of calls that continued an earlier call of their session (one row);
        ``served/samples_per_session``; ``served/truncated``: rows cut at the response budget; the engine's
        batch sizes."""
        flat = [s for seqs in per_session for s in seqs]
        calls = sum(s.calls for s in flat)
        return {
            "served/calls_per_session": calls / max(len(per_session), 1),
            "served/joined_calls": (calls - len(flat)) / max(calls, 1),
            "served/samples_per_session": len(flat) / max(len(per_session), 1),
            "served/truncated": sum(len(s.ids) > self.response_length for s in flat) / max(len(flat), 1),
            "served/engine_calls": float(len(batch_sizes)),
            "served/batch_rows/mean": float(np.mean(batch_sizes)) if batch_sizes else 0.0,
            "served/batch_rows/max": float(max(batch_sizes, default=0)),
        }


class SessionRewards:
    """The reward function of a served rollout: each row's ``agent_reward`` on its last response token;
    the agent's extra values (a dict's other keys) as ``reward_extra_info``."""

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        if "agent_reward" not in data.non_tensor_batch:
            raise KeyError("SessionRewards needs the served rollout's 'agent_reward' column")
        mask = data.batch["response_mask"]
        scores = torch.zeros(mask.shape, dtype=torch.float32)
        last = (mask * torch.arange(mask.shape[1])).argmax(dim=1)
        scores[torch.arange(len(mask)), last] = torch.tensor(
            [float(r) for r in data.non_tensor_batch["agent_reward"]], dtype=torch.float32
        )
        if not return_dict:
            return scores
        extras = list(data.non_tensor_batch.get("agent_extra", [{}] * len(data)))
        keys = sorted({k for e in extras for k in e})
        return {"reward_tensor": scores, "reward_extra_info": {k: [e.get(k) for e in extras] for k in keys}}
