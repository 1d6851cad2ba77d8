"""Generation requests from many connections, generated together: one engine call per batch.

Why: 32 agents each waiting on their own call would cost 32 sequential generations; the rollout engine
(``generate_sequences``) is built for a batch. Requests that arrive less than ``window_s`` apart (a burst,
held at most ``MAX_WAIT_S``), and all that arrive while the engine is busy, go to the engine in one call, each ``n`` times as
rows; rows sampled with different settings (temperature, top-p) go in separate calls of the same round. A
request with a ``seed`` is generated alone under that seed, so it is reproducible.

The engine is any ``Rollout`` (the rollout contract, ``hybridflow.rollout``): left-padded prompts
in, ``responses``, ``response_mask`` (through the first EOS) and ``rollout_log_probs`` out, ``meta_info``
overriding ``n``, ``response_length`` and the sampling keys. It runs in one worker thread, never on the
event loop, so requests keep arriving while it generates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.data.dataset import left_pad
from hybridflow.models.vision import IMAGES, ImageInput
from hybridflow.protocol import DataProto
from hybridflow.rollout import Rollout
from hybridflow.serving.token_text import TokenText

MAX_WAIT_S = 0.05  # the longest a burst of arrivals holds the first of them back


@dataclass
class GenerationRequest:
    """``n`` samples after ``prompt_ids``; ``temperature`` 0 means greedy. ``stop``: strings that end a
    sample (the text returned stops before them; the token that completed one is kept in the ids)."""

    prompt_ids: list[int]
    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    images: tuple[ImageInput, ...] = ()  # the prompt's images, in the order of their tokens

    def sampling_key(self) -> tuple:
        """Requests with the same key can share one engine call."""
        return (self.temperature, self.top_p, self.seed)


@dataclass
class Sample:
    """One sampled continuation: its token ids, their log-probs under the sampling temperature (0 when
    greedy), its text (cut before a stop string) and why it ended: ``stop`` (EOS or a stop string) or
    ``length``."""

    token_ids: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str
    ended_by_eos: bool


@dataclass
class Generation:
    """The ``n`` samples of one request and the weight version that produced them."""

    samples: list[Sample]
    weight_version: int


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future


class Batcher:
    """``await batcher.generate(request)`` from any coroutine on one event loop.

    ``engine``: the rollout engine; ``text``: the tokenizer's text of token ids; ``eos_token_ids``; ``pad_token_id``;
    ``weight_version``: read at each engine call; ``window_s``: how long the first waiting request waits
    for others; ``on_batch(rows, requests)``: told the size of every engine call (metrics, logs)."""

    def __init__(
        self,
        engine: Rollout,
        text: TokenText,
        eos_token_ids: list[int],
        pad_token_id: int,
        weight_version: Callable[[], int],
        window_s: float,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        self.engine, self.text = engine, text
        self.eos_token_ids, self.pad_token_id = set(eos_token_ids), pad_token_id
        self.weight_version, self.window_s, self.on_batch = weight_version, window_s, on_batch
        self._queue: list[_Pending] = []
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridflow-engine")
        self.batch_sizes: list[int] = []  # rows of every engine call, in order

    async def generate(self, request: GenerationRequest) -> Generation:
        """The request's samples, generated in the next engine call that has room for it."""
        if self._worker is None or self._wake is None:
            self._wake = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._run(self._wake))
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(request, future))
        self._wake.set()
        return await future

    async def close(self) -> None:
        """Stop taking requests and let the engine's thread go."""
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None
        self._executor.shutdown(wait=False)

    async def _run(self, wake: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await wake.wait()
            waited, seen = 0.0, -1
            while self.window_s > 0 and len(self._queue) != seen and waited < MAX_WAIT_S:
                seen = len(self._queue)  # a burst still arriving: wait until a window passes without news
                await asyncio.sleep(self.window_s)
                waited += self.window_s
            wake.clear()
            taken, self._queue = self._queue, []
            for group in _groups(taken):
                try:
                    results = await loop.run_in_executor(self._executor, self._generate, group)
                except Exception as error:  # noqa: BLE001 - the callers get the engine's error
                    for pending in group:
                        if not pending.future.done():
                            pending.future.set_exception(error)
                    continue
                for pending, result in zip(group, results):
                    if not pending.future.done():  # a caller that went away cancelled its future
                        pending.future.set_result(result)

    def _generate(self, group: list[_Pending]) -> list[Generation]:
        """One engine call for ``group`` (same sampling settings), in the engine's thread."""
        requests = [p.request for p in group]
        first = requests[0]
        rows = [r.prompt_ids for r in requests for _ in range(r.n)]
        width = max(map(len, rows))
        padded = [left_pad(ids, width, self.pad_token_id) for ids in rows]
        meta: dict[str, Any] = {"n": 1, "response_length": max(r.max_tokens for r in requests)}
        if first.temperature <= 0:
            meta["do_sample"] = False
        else:
            meta.update(do_sample=True, temperature=first.temperature, top_p=first.top_p)
        images = (
            {IMAGES: [r.images for r in requests for _ in range(r.n)]}
            if any(r.images for r in requests)
            else {}
        )
        batch = DataProto.from_dict(
            {k: torch.stack([p[k] for p in padded]) for k in padded[0]}, images, meta_info=meta
        )
        version = self.weight_version()
        start = time.perf_counter()
        if first.seed is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(first.seed)
                out = self.engine.generate_sequences(batch)
        else:
            out = self.engine.generate_sequences(batch)
        self.last_engine_s = time.perf_counter() - start
        self.batch_sizes.append(len(rows))
        if self.on_batch is not None:
            self.on_batch(len(rows), len(requests))
        lengths = out.tensors["response_mask"].sum(-1).tolist()
        responses, log_probs = out.tensors["responses"].tolist(), out.tensors["rollout_log_probs"].tolist()
        results, row = [], 0
        for request in requests:
            samples = []
            for _ in range(request.n):
                keep = min(int(lengths[row]), request.max_tokens)
                samples.append(self._sample(responses[row][:keep], log_probs[row][:keep], request.stop))
                row += 1
            results.append(Generation(samples, version))
        return results

    def _sample(self, ids: list[int], log_probs: list[float], stop: list[str]) -> Sample:
        ended = bool(ids) and ids[-1] in self.eos_token_ids
        text = self.text.decode(ids[:-1] if ended else ids)
        if stop:
            cut = _stop_cut(text, stop)
            if cut is not None:  # keep the tokens up to the stop string's end (as vLLM does); cut the text
                keep = self.text.tokens_for(ids, cut[1])
                return Sample(ids[:keep], log_probs[:keep], text[: cut[0]], "stop", False)
        return Sample(ids, log_probs, text, "stop" if ended else "length", ended)


def _groups(pending: list[_Pending]) -> list[list[_Pending]]:
    """The queue cut into engine calls: one per sampling setting, a seeded request alone."""
    groups: dict[tuple, list[_Pending]] = {}
    alone = []
    for p in pending:
        if p.request.seed is not None:
            alone.append([p])
        else:
            groups.setdefault(p.request.sampling_key(), []).append(p)
    return list(groups.values()) + alone


def _stop_cut(text: str, stop: list[str]) -> tuple[int, int] | None:
    """Where the earliest stop string starts and ends in ``text``, or None."""
    found = [(i, i + len(s)) for s in stop if s and (i := text.find(s)) >= 0]
    return min(found) if found else None
