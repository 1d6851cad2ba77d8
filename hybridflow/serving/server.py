"""``PolicyServer``: an OpenAI-compatible HTTP endpoint over a rollout engine (aiohttp).

Routes (each also under ``/sessions/<id>``, which attributes the call to that session, as the
``X-Session-Id`` header does): ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
and ``POST /v1/generate`` (token ids in, sampled ids and their log-probs out, for agents that manage their
own tokens); ``GET /metrics`` says how the calls were batched. Every answer names the weight version that
produced it (``weight_version`` in the body, ``X-Weight-Version`` header). Errors are OpenAI's error JSON
(400 bad request, 401 no or wrong token, 404 unknown route, 500 engine failure).

It binds 127.0.0.1 unless told otherwise; any other address needs a token, and then every request must
carry ``Authorization: Bearer <token>``. ``stream: true`` answers as server-sent events; the engine
generates whole samples in batches, so the events follow the finished sample token by token.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from hybridflow.data.images import ImagePrompts, decode_image
from hybridflow.models.vision import ImageInput
from hybridflow.serving import openai_format as fmt
from hybridflow.serving.batcher import Batcher, Generation, GenerationRequest
from hybridflow.serving.openai_format import RequestError, error_body
from hybridflow.serving.sessions import CallRecord, ChatPrompter, ChatTurn, Session
from hybridflow.utils.errors import InputError, UserError

logger = logging.getLogger(__name__)
SESSION_HEADER = "X-Session-Id"
VERSION_HEADER = "X-Weight-Version"
MAX_REMEMBERED_CALLS = 100_000  # tool-call ids whose text is kept for when the agent sends them back


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PolicyServer:
    """Serve ``engine`` (the rollout contract) under the name ``model_name``.

    ``max_tokens_limit``: the most tokens a call may ask for (and the default of a chat call);
    ``max_model_len``: prompt + ``max_tokens`` may not exceed it (None: unchecked); ``window_s``: how long
    a request waits for others to batch with; ``weight_version``: read at each engine call; ``processor``: a
    vision-language model's ``ImagePrompts``, with which chat calls take ``image_url`` parts (``data:`` URLs,
    or local files inside ``allowed_local_media_path``)."""

    def __init__(
        self,
        engine: Any,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_tokens_limit: int = 512,
        max_model_len: int | None = None,
        window_s: float = 0.002,
        weight_version: Callable[[], int] = lambda: 0,
        processor: ImagePrompts | None = None,
        allowed_local_media_path: str | None = None,
    ) -> None:
        if not is_loopback(host) and not token:
            raise UserError(
                f"serving on {host} (not a loopback address) needs a token (--token or "
                "HYBRIDFLOW_SERVE_TOKEN): anyone who can reach the port could use the model otherwise"
            )
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.host, self.port, self.token = host, port, token
        self.max_tokens_limit, self.max_model_len = max_tokens_limit, max_model_len
        self.weight_version = weight_version
        # a vision-language model's image processing: chat calls may then send image_url parts (data: URLs;
        # local files only inside allowed_local_media_path; never fetched from the network)
        self.processor, self.media = processor, allowed_local_media_path
        self.default_sampling = {"temperature": 1.0, "top_p": 1.0}  # for requests that set none
        eos = list(getattr(engine, "eos_token_ids", None) or [tokenizer.eos_token_id])
        self.prompter = ChatPrompter(tokenizer, eos[0])
        self.batcher = Batcher(
            engine,
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
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
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=16 * 2**20)
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
        self.port = site._server.sockets[0].getsockname()[1]
        return self.base_url

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def session_url(self, session: str) -> str:
        return self.base_url.removesuffix("/v1") + f"/sessions/{session}/v1"

    async def stop(self) -> None:
        await self.batcher.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start_in_thread(self) -> str:
        """Serve from an event loop in a daemon thread (the caller's thread stays free); the base URL."""
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self.start())
            except BaseException as error:  # noqa: BLE001 - reported to the starting thread
                failure.append(error)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="hybridflow-server", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return self.base_url

    def stop_thread(self) -> None:
        if self._loop is None or self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(self.stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
        self._loop = self._thread = None

    # ------------------------------------------------------------------ sessions
    def take_session(self, session: str) -> Session:
        """The session's records, removed from the server."""
        return self.sessions.pop(session, Session())

    def _session(self, request: web.Request) -> Session | None:
        name = request.match_info.get("session") or request.headers.get(SESSION_HEADER)
        return self.sessions.setdefault(name, Session()) if name else None

    # ------------------------------------------------------------------ middlewares
    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as error:
            kind = "authentication_error" if error.status == 401 else "invalid_request_error"
            return self._json(error_body(str(error), kind, error.param, error.code), error.status)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            message = f"{request.method} {request.path}: {error.reason}"
            return self._json(error_body(message, "invalid_request_error"), error.status)
        except ConnectionResetError:
            raise  # the client went away: nobody to answer
        except Exception as error:  # noqa: BLE001 - an engine failure is the server's error, in JSON
            logger.exception("request %s failed", request.path)
            return self._json(error_body(f"{type(error).__name__}: {error}", "server_error"), 500)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if self.token:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                raise RequestError(
                    "a valid 'Authorization: Bearer <token>' header is required",
                    status=401,
                    code="invalid_api_key",
                )
        return await handler(request)

    def _json(self, body: dict, status: int = 200, version: int | None = None) -> web.Response:
        version = self.weight_version() if version is None else version
        return web.json_response(body, status=status, headers={VERSION_HEADER: str(version)})

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"the request body is not valid JSON: {err}") from err
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        self.requests += 1
        return body

    # ------------------------------------------------------------------ routes
    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "hybridflow",
        }
        return self._json({"object": "list", "data": [model]})

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
        choices = []
        for i, s in enumerate(generation.samples):
            message, called = fmt.assistant_message(s.text, bool(tools))
            for call in message.get("tool_calls", []):
                self.raw_replies[call["id"]] = s.text
                if len(self.raw_replies) > MAX_REMEMBERED_CALLS:
                    self.raw_replies.popitem(last=False)
            if session is not None:
                session.turns.append(
                    ChatTurn(
                        messages, s.text, prompt_ids, s.token_ids, s.ended_by_eos, s.finish_reason == "length"
                    )
                )
            choice = {"index": i, "message": message, "finish_reason": called or s.finish_reason}
            choice["logprobs"] = {"content": self._token_logprobs(s)} if want_logprobs else None
            if body.get("return_token_ids"):
                choice["token_ids"] = s.token_ids
            choices.append(choice)
        out = fmt.envelope(
            "chat.completion",
            body["model"],
            choices,
            self._usage(prompt_ids, generation),
            generation.weight_version,
        )
        if body.get("return_token_ids"):  # vLLM's extension: the exact ids, for agents that keep tokens
            out["prompt_token_ids"] = prompt_ids
        if body.get("stream"):
            return await self._stream_chat(request, out, generation, body)
        return self._json(out, version=generation.weight_version)

    def _images(self, pictures: list[bytes] | None) -> tuple[ImageInput, ...]:
        """The chat call's images as the model takes them; one that does not decode is a 400."""
        try:
            return tuple(
                self.processor.image_input(*decode_image(data, f"image {k} of the messages"))
                for k, data in enumerate(pictures or [])
            )
        except InputError as err:
            raise RequestError(str(err), "messages") from err

    def _image_prompt_ids(
        self, messages: fmt.Messages, images: tuple[ImageInput, ...], tools: list[dict[str, Any]]
    ) -> list[int]:
        try:
            return self.processor.encode(messages, images, "messages", {"tools": tools} if tools else None)
        except InputError as err:
            raise RequestError(str(err), "messages") from err

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        params = fmt.sampling(body, 16, self.max_tokens_limit, self.default_sampling)
        want_logprobs = fmt.check_logprobs(body, chat=False)
        if body.get("echo"):
            raise RequestError("'echo' is not supported", "echo")
        prompts = self._completion_prompts(body.get("prompt"))
        session = self._session(request)
        generations = await asyncio.gather(*(self._sample(p, params, session) for p in prompts))
        choices = []
        for generation in generations:
            for s in generation.samples:
                choice = {"index": len(choices), "text": s.text, "finish_reason": s.finish_reason}
                choice["logprobs"] = self._legacy_logprobs(s) if want_logprobs else None
                choices.append(choice)
        version = generations[0].weight_version
        tokens = sum(len(s.token_ids) for g in generations for s in g.samples)
        out = fmt.envelope(
            "text_completion", body["model"], choices, fmt.usage(sum(map(len, prompts)), tokens), version
        )
        if body.get("stream"):
            return await self._stream_completion(request, out)
        return self._json(out, version=version)

    async def _generate(self, request: web.Request) -> web.Response:
        """Token ids in, token ids out: ``prompt_ids`` and the sampling fields of a completion call."""
        body = await self._body(request)
        body.setdefault("model", self.model_name)
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
        out = {
            "id": f"gen-{uuid.uuid4().hex}",
            "object": "generation",
            "model": body["model"],
            "prompt_ids": prompt_ids,
            "choices": choices,
            "weight_version": generation.weight_version,
        }
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

    def _usage(self, prompt_ids: list[int], generation: Generation) -> dict[str, int]:
        return fmt.usage(len(prompt_ids), sum(len(s.token_ids) for s in generation.samples))

    def _token_logprobs(self, sample: Any) -> list[dict[str, Any]]:
        out = []
        for token_id, log_prob in zip(sample.token_ids, sample.log_probs):
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            out.append({"token": text, "logprob": log_prob, "bytes": list(text.encode()), "top_logprobs": []})
        return out

    def _legacy_logprobs(self, sample: Any) -> dict[str, Any]:
        tokens = [self.tokenizer.decode([t], skip_special_tokens=False) for t in sample.token_ids]
        offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": sample.log_probs,
            "top_logprobs": None,
            "text_offset": offsets,
        }

    async def _sse(self, request: web.Request, events: list[dict], version: int) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                VERSION_HEADER: str(version),
            }
        )
        await response.prepare(request)
        for event in events:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _stream_chat(
        self, request: web.Request, out: dict, generation: Generation, body: dict
    ) -> web.StreamResponse:
        """The finished chat answer as chunks: the role, the content token by token, the tool calls, the
        finish reason (and the usage when ``stream_options.include_usage``)."""
        head = {k: out[k] for k in ("id", "created", "model", "weight_version")}
        head["object"] = "chat.completion.chunk"
        events = []
        for choice, sample in zip(out["choices"], generation.samples):
            i, message = choice["index"], choice["message"]
            events.append(
                {
                    **head,
                    "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    ],
                }
            )
            for piece in self._pieces(sample.token_ids, message["content"] or ""):
                events.append(
                    {**head, "choices": [{"index": i, "delta": {"content": piece}, "finish_reason": None}]}
                )
            if message.get("tool_calls"):
                calls = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
                events.append(
                    {**head, "choices": [{"index": i, "delta": {"tool_calls": calls}, "finish_reason": None}]}
                )
            events.append(
                {**head, "choices": [{"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}]}
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**head, "choices": [], "usage": out["usage"]})
        return await self._sse(request, events, generation.weight_version)

    async def _stream_completion(self, request: web.Request, out: dict) -> web.StreamResponse:
        head = {k: out[k] for k in ("id", "object", "created", "model", "weight_version")}
        events = [
            {
                **head,
                "choices": [
                    {
                        "index": c["index"],
                        "text": c["text"],
                        "finish_reason": c["finish_reason"],
                        "logprobs": None,
                    }
                ],
            }
            for c in out["choices"]
        ]
        return await self._sse(request, events, out["weight_version"])

    def _pieces(self, token_ids: list[int], text: str) -> list[str]:
        """``text`` cut where the tokens' text grows, so the chunks join to exactly ``text``."""
        pieces, done = [], 0
        for k in range(1, len(token_ids) + 1):
            upto = min(len(self.tokenizer.decode(token_ids[:k], skip_special_tokens=False)), len(text))
            if upto > done:
                pieces.append(text[done:upto])
                done = upto
        if done < len(text):
            pieces.append(text[done:])
        return pieces
