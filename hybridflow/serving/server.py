"""``PolicyServer``: an OpenAI-compatible HTTP endpoint over any rollout (aiohttp).

Routes (each also under ``/sessions/<id>``, which attributes the call to that session, as the
``X-Session-Id`` header does): ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
and ``POST /v1/generate`` (token ids in, sampled ids and their log-probs out, for agents that manage their
own tokens); ``GET /metrics`` says how the calls were batched. Every answer names the weight version that
produced it (``weight_version`` in the body, ``X-Weight-Version`` header). Errors are OpenAI's error JSON
(400 bad request, 401 no or wrong token, 403 a web page's request, 404 unknown route or model, 415 a body
that is not JSON, 500 engine failure). A request must name a model the server serves (its name or an
alias, as ``GET /v1/models`` lists them), else 404 ``model_not_found``.

This module is the routes and the sessions; who may call and the HTTP plumbing are ``http``'s, what goes
over the wire ``openai_format``'s, the batching of calls ``batcher``'s. ``stream: true`` answers as
server-sent events; the engine generates whole samples in batches, so the events follow the finished sample
token by token.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from hybridflow.data.images import ImagePrompts, decode_image
from hybridflow.models.vision import ImageInput
from hybridflow.rollout import Rollout
from hybridflow.serving import openai_format as fmt
from hybridflow.serving.batcher import Batcher, Generation, GenerationRequest, Sample
from hybridflow.serving.http import (
    LoopThread,
    errors_as_json,
    guard,
    is_loopback,
    json_response,
    read_json,
    send_events,
)
from hybridflow.serving.openai_format import RequestError
from hybridflow.serving.sessions import CallRecord, ChatPrompter, ChatTurn, Session
from hybridflow.serving.token_text import TokenText
from hybridflow.utils.errors import InputError, UserError

logger = logging.getLogger(__name__)
SESSION_HEADER = "X-Session-Id"
MAX_REMEMBERED_CALLS = 100_000  # tool-call ids whose text is kept for when the agent sends them back


class PolicyServer:
    """Serve ``engine`` (any ``Rollout``) under ``model_names`` (the first is its name, the others aliases).

    ``max_tokens_limit``: the most tokens a call may ask for (and the default of a chat call);
    ``max_model_len``: prompt + ``max_tokens`` may not exceed it (None: unchecked); ``window_s``: how long
    a request waits for others to batch with; ``weight_version``: read at each engine call; ``processor``: a
    vision-language model's ``ImagePrompts``, with which chat calls take ``image_url`` parts (``data:`` URLs,
    or local files inside ``allowed_local_media_path``)."""

    def __init__(
        self,
        engine: Rollout,
        tokenizer: PreTrainedTokenizerBase,
        model_names: str | Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_tokens_limit: int,
        max_model_len: int | None = None,
        window_s: float,
        weight_version: Callable[[], int] = lambda: 0,
        processor: ImagePrompts | None = None,
        allowed_local_media_path: str | None = None,
    ) -> None:
        if not is_loopback(host) and not token:
            raise UserError(
                f"serving on {host} (not a loopback address) needs a token (--token or "
                "HYBRIDFLOW_SERVE_TOKEN): anyone who can reach the port could use the model otherwise"
            )
        self.model_names = [model_names] if isinstance(model_names, str) else list(model_names)
        self.engine, self.tokenizer, self.text = engine, tokenizer, TokenText(tokenizer)
        self.host, self.port, self.token = host, port, token
        self.max_tokens_limit, self.max_model_len = max_tokens_limit, max_model_len
        self.weight_version = weight_version
        # a vision-language model's image processing: chat calls may then send image_url parts (data: URLs;
        # local files only inside allowed_local_media_path; never fetched from the network)
        self.processor, self.media = processor, allowed_local_media_path
        self.default_sampling = {"temperature": 1.0, "top_p": 1.0}  # for requests that set none
        eos = list(engine.eos_token_ids)
        self.prompter = ChatPrompter(tokenizer, eos[0])
        self.batcher = Batcher(
            engine,
            self.text,
            eos,
            tokenizer.pad_token_id,
            weight_version,
            window_s,
            lambda rows, requests: logger.info("engine call: %d rows from %d requests", rows, requests),
        )
        self.sessions: dict[str, Session] = {}
        self.raw_replies: OrderedDict[str, str] = OrderedDict()  # tool-call id -> the text the model wrote
        self.requests = 0
        self._runner: web.AppRunner | None = None
        self._thread = LoopThread(self.start, self.stop)

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        """The aiohttp application: the routes, under ``/`` and under every session's prefix."""
        middlewares = [errors_as_json(self.weight_version), guard(self.token)]
        app = web.Application(middlewares=middlewares, client_max_size=16 * 2**20)
        for prefix in ("", "/sessions/{session}"):
            app.router.add_get(f"{prefix}/v1/models", self._models)
            app.router.add_post(f"{prefix}/v1/chat/completions", self._chat)
            app.router.add_post(f"{prefix}/v1/completions", self._completions)
            app.router.add_post(f"{prefix}/v1/generate", self._generate)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> str:
        """Listen on the running loop; returns the base URL (ending in ``/v1``)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server  # aiohttp keeps the listening asyncio server here
        if not isinstance(server, asyncio.Server):
            raise RuntimeError(f"the HTTP site did not start a listening server ({server!r})")
        self.port = server.sockets[0].getsockname()[1]
        return self.base_url

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``, what an ``openai`` client takes as its ``base_url``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def session_url(self, session: str) -> str:
        """The base URL whose calls are recorded under ``session``."""
        return self.base_url.removesuffix("/v1") + f"/sessions/{session}/v1"

    async def stop(self) -> None:
        """Stop listening and the batcher (on the loop that serves)."""
        await self.batcher.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start_in_thread(self) -> str:
        """Serve from an event loop in a daemon thread (the caller's thread stays free); the base URL."""
        self._thread.run()
        return self.base_url

    def stop_thread(self) -> None:
        """Stop a server started by ``start_in_thread`` and join its thread."""
        self._thread.join()

    # ------------------------------------------------------------------ sessions
    def take_session(self, session: str) -> Session:
        """The session's records, removed from the server."""
        return self.sessions.pop(session, Session())

    def _session(self, request: web.Request) -> Session | None:
        name = request.match_info.get("session") or request.headers.get(SESSION_HEADER)
        return self.sessions.setdefault(name, Session()) if name else None

    def _json(self, body: dict, version: int | None = None) -> web.Response:
        return json_response(body, self.weight_version() if version is None else version)

    async def _body(self, request: web.Request) -> dict:
        body = await read_json(request)
        self.requests += 1
        return body

    # ------------------------------------------------------------------ routes
    async def _models(self, request: web.Request) -> web.Response:
        return self._json(fmt.model_list(self.model_names))

    async def _metrics(self, request: web.Request) -> web.Response:
        sizes = self.batcher.batch_sizes
        return self._json(
            {
                "requests": self.requests,
                "engine_calls": len(sizes),
                "batch_rows": sizes,
                "max_batch_rows": max(sizes, default=0),
            }
        )

    async def _sample(
        self, prompt_ids: list[int], params: dict, session: Session | None, images: tuple = ()
    ) -> Generation:
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        if self.max_model_len is not None and len(prompt_ids) + params["max_tokens"] > self.max_model_len:
            raise RequestError(
                f"the prompt's {len(prompt_ids)} tokens + max_tokens {params['max_tokens']} exceed the model's "
                f"{self.max_model_len}-token context",
                "max_tokens",
                code="context_length_exceeded",
            )
        generation = await self.batcher.generate(GenerationRequest(prompt_ids, **params, images=images))
        if session is not None:
            session.records += [
                CallRecord(list(prompt_ids), s.token_ids, s.log_probs, generation.weight_version, images)
                for s in generation.samples
            ]
        return generation

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        model = fmt.requested_model(body, self.model_names)
        params = fmt.sampling(body, self.max_tokens_limit, self.max_tokens_limit, self.default_sampling)
        want_logprobs = fmt.check_logprobs(body, chat=True)
        tools = fmt.tool_schemas(body)
        pictures: list[bytes] | None = [] if self.processor is not None else None
        messages = fmt.template_messages(body.get("messages"), self.raw_replies, pictures, self.media)
        if tools and self.prompter.render(messages, tools, True) == self.prompter.render(messages, [], True):
            messages = fmt.with_tools_in_system(messages, tools)  # the template ignores tools: describe them
        session = self._session(request)
        images = self._images(pictures)
        if images:  # rendered afresh: the image tokens come from the processor
            prompt_ids = self._image_prompt_ids(messages, images, tools)
        else:
            prompt_ids = self.prompter.prompt_ids(messages, tools, session)
        generation = await self._sample(prompt_ids, params, session, images)
        choices = [
            self._chat_choice(i, s, bool(tools), want_logprobs, bool(body.get("return_token_ids")))
            for i, s in enumerate(generation.samples)
        ]
        if session is not None:
            session.turns += [
                ChatTurn(
                    messages, s.text, prompt_ids, s.token_ids, s.ended_by_eos, s.finish_reason == "length"
                )
                for s in generation.samples
            ]
        completion_tokens = sum(len(s.token_ids) for s in generation.samples)
        usage = fmt.usage(len(prompt_ids), completion_tokens)
        out = fmt.envelope("chat.completion", model, choices, usage, generation.weight_version)
        if body.get("return_token_ids"):  # vLLM's extension: the exact ids, for agents that keep tokens
            out["prompt_token_ids"] = prompt_ids
        if body.get("stream"):
            pieces = [
                self.text.pieces(s.token_ids, c["message"]["content"] or "")
                for s, c in zip(generation.samples, choices)
            ]
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await send_events(
                request, fmt.chat_chunks(out, pieces, include_usage), generation.weight_version
            )
        return self._json(out, version=generation.weight_version)

    def _images(self, pictures: list[bytes] | None) -> tuple[ImageInput, ...]:
        """The chat call's images as the model takes them; one that does not decode is a 400."""
        processor = self.processor
        if processor is None or not pictures:  # a text model reads no images (pictures is None then)
            return ()
        try:
            return tuple(
                processor.image_input(*decode_image(data, f"image {k} of the messages"))
                for k, data in enumerate(pictures)
            )
        except InputError as err:
            raise RequestError(str(err), "messages") from err

    def _image_prompt_ids(
        self, messages: fmt.Messages, images: tuple[ImageInput, ...], tools: list[dict[str, Any]]
    ) -> list[int]:
        if self.processor is None:  # only images bring us here, and only a vision model takes them
            raise RuntimeError("image prompts need the model's image processing")
        try:
            return self.processor.encode(messages, images, "messages", {"tools": tools} if tools else None)
        except InputError as err:
            raise RequestError(str(err), "messages") from err

    def _chat_choice(self, index: int, sample: Sample, tools: bool, logprobs: bool, ids: bool) -> dict:
        """One chat choice; the tool calls it holds are remembered with the text the model wrote, for when
        the agent sends them back."""
        message, called = fmt.assistant_message(sample.text, tools)
        for call in message.get("tool_calls", []):
            self.raw_replies[call["id"]] = sample.text
            if len(self.raw_replies) > MAX_REMEMBERED_CALLS:
                self.raw_replies.popitem(last=False)
        choice = {"index": index, "message": message, "finish_reason": called or sample.finish_reason}
        choice["logprobs"] = (
            {"content": fmt.token_logprobs(self.text, sample.token_ids, sample.log_probs)}
            if logprobs
            else None
        )
        if ids:
            choice["token_ids"] = sample.token_ids
        return choice

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        model = fmt.requested_model(body, self.model_names)
        params = fmt.sampling(body, 16, self.max_tokens_limit, self.default_sampling)
        want_logprobs = fmt.check_logprobs(body, chat=False)
        if body.get("echo"):
            raise RequestError("'echo' is not supported", "echo")
        prompts = self._completion_prompts(body.get("prompt"))
        session = self._session(request)
        generations = await asyncio.gather(*(self._sample(p, params, session) for p in prompts))
        samples = [s for generation in generations for s in generation.samples]
        choices = [
            {
                "index": i,
                "text": s.text,
                "finish_reason": s.finish_reason,
                "logprobs": fmt.legacy_logprobs(self.text, s.token_ids, s.log_probs)
                if want_logprobs
                else None,
            }
            for i, s in enumerate(samples)
        ]
        version = generations[0].weight_version
        usage = fmt.usage(sum(map(len, prompts)), sum(len(s.token_ids) for s in samples))
        out = fmt.envelope("text_completion", model, choices, usage, version)
        if body.get("stream"):
            return await send_events(request, fmt.completion_chunks(out), version)
        return self._json(out, version=version)

    async def _generate(self, request: web.Request) -> web.Response:
        """Token ids in, token ids out: ``prompt_ids`` and the sampling fields of a completion call."""
        body = await self._body(request)
        model = fmt.requested_model(body, self.model_names, required=False)
        params = fmt.sampling(body, 16, self.max_tokens_limit, self.default_sampling)
        prompt_ids = self._token_ids(body.get("prompt_ids"), "prompt_ids")
        generation = await self._sample(prompt_ids, params, self._session(request))
        choices = [
            {
                "index": i,
                "token_ids": s.token_ids,
                "logprobs": s.log_probs,
                "text": s.text,
                "finish_reason": s.finish_reason,
            }
            for i, s in enumerate(generation.samples)
        ]
        out = fmt.generation_body(model, prompt_ids, choices, generation.weight_version)
        return self._json(out, version=generation.weight_version)

    # ------------------------------------------------------------------ helpers
    def _token_ids(self, value: Any, param: str) -> list[int]:
        vocab = len(self.tokenizer)
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in value)
        ):
            raise RequestError(f"'{param}' must be a non-empty list of token ids in [0, {vocab})", param)
        return value

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.prompter.encode(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [self.prompter.encode(p) for p in prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            return [self._token_ids(p, "prompt") for p in prompt]
        if isinstance(prompt, list):
            return [self._token_ids(prompt, "prompt")]
        raise RequestError("'prompt' must be a string, a list of strings or token ids", "prompt")
