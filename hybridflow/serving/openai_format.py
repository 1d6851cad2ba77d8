"""OpenAI's wire format: request and response shapes, stream events, errors, and the mapping between its
messages and the chat template's. The server (``server.py``) keeps HTTP, auth, sessions and batching; what
goes over the wire is built here.

Requests are checked field by field; a bad one raises ``RequestError`` (HTTP 400, OpenAI's error JSON, the
message naming the field; 404 ``model_not_found`` for a model the server does not serve). Log-probs carry
each token's raw bytes (``token_text``), so joined they give the completion back byte for byte. Tools come in OpenAI's function-calling form and go to the chat template as
``tools=[{"type": "function", "function": {...}}]``, the form Hugging Face templates that know tools read
(Qwen2.5's); a template that ignores them (ChatML without tools, the tiny model's, SmolLM2's) gets the
same schemas in a system message in the Hermes format the model is asked to call them in. What the model
writes is parsed back with the Hermes parser (``hybridflow.tools.parse_tool_calls``) into ``tool_calls``.

An assistant message that comes back with the ``tool_calls`` this server issued is rendered with the text
the model wrote (remembered by call id), not with a re-serialised JSON that could tokenize differently.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from hybridflow.data.images import content_text
from hybridflow.serving.token_text import TokenText
from hybridflow.tools import parse_tool_calls
from hybridflow.tools.parsing import CLOSE, OPEN
from hybridflow.utils.errors import InputError, UserError

Messages = list[dict[str, Any]]

TOOLS_SYSTEM = (
    "You can call functions. Their signatures are inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    'To call one, reply with <tool_call>{{"name": <function name>, "arguments": <arguments object>}}'
    "</tool_call>; its result comes back in the next message."
)
MAX_N = 64


class RequestError(UserError):
    """A request the server cannot serve: HTTP ``status`` with OpenAI's error JSON naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: what went wrong, its kind, the field at fault and a machine-readable code."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RequestError(f"'{key}' must be a number in [{low}, {high}], got {value!r}", key)
    return float(value)


def _integer(body: dict, key: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"'{key}' must be an integer {bounds}, got {value!r}", key)
    return value


def sampling(
    body: dict, max_tokens_default: int, max_tokens_limit: int, defaults: dict[str, float]
) -> dict[str, Any]:
    """``n``, ``temperature``, ``top_p``, ``max_tokens`` (or ``max_completion_tokens``), ``stop``, ``seed``;
    ``defaults`` gives the temperature and top-p of a request that sets none."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise RequestError("'stop' must be a string or a list of at most 4 strings", "stop")
    return {
        "n": _integer(body, "n", 1, 1, MAX_N),
        "temperature": _number(body, "temperature", defaults["temperature"], 0.0, 2.0),
        "top_p": _number(body, "top_p", defaults["top_p"], 0.0, 1.0) or 1.0,
        "max_tokens": _integer(body, key, max_tokens_default, 1, max_tokens_limit),
        "stop": stop,
        "seed": _integer(body, "seed", None, -(2**63)),
    }


def requested_model(body: dict, names: list[str], required: bool = True) -> str:
    """The model a request names, which must be one of ``names`` (the served model and its aliases): any other
    name is a 404 ``model_not_found``, as from OpenAI. Without ``required`` (the token route) a request that
    names none gets the first."""
    model = body.get("model")
    if model is None and not required:
        return names[0]
    if not isinstance(model, str):
        raise RequestError("'model' is required and must be a string", "model")
    if model not in names:
        raise RequestError(
            f"the model {model!r} does not exist: this server serves {', '.join(map(repr, names))} "
            "(GET /v1/models lists them)",
            "model",
            status=404,
            code="model_not_found",
        )
    return model


def check_logprobs(body: dict, chat: bool) -> bool:
    """Whether log-probs were asked for; top alternatives are not (the engine returns only the sampled
    token's), so asking for them is refused rather than answered with empty lists."""
    if chat:
        wanted = body.get("logprobs") or False
        if not isinstance(wanted, bool):
            raise RequestError("'logprobs' must be a boolean", "logprobs")
        if body.get("top_logprobs"):
            raise RequestError(
                "'top_logprobs' > 0 is not supported: only the sampled token's", "top_logprobs"
            )
        return wanted
    wanted = body.get("logprobs")
    if wanted not in (None, 0) and (isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 0):
        raise RequestError("'logprobs' must be an integer >= 0", "logprobs")
    if wanted:
        raise RequestError("'logprobs' > 0 (top alternatives) is not supported; use 0", "logprobs")
    return wanted == 0


def tool_schemas(body: dict) -> list[dict[str, Any]]:
    """The request's ``tools`` as the template takes them (``[]`` with ``tool_choice: none``)."""
    tools = body.get("tools") or []
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise RequestError(
            f"tool_choice {choice!r} is not supported (the model cannot be forced to call): use 'auto' or 'none'",
            "tool_choice",
        )
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise RequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                f"tools[{i}]",
            )
    return [] if choice == "none" else tools


def _content_text(content: Any, where: str, images: list[bytes] | None, media: str | None) -> str:
    """A message's content as text; ``image_url`` parts become ``<image>`` markers, their images (``data:``
    URLs, or files inside ``media``, the server's ``--allowed-local-media-path``) appended to ``images``
    (None: the model is a text model, and image parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    if isinstance(content, list) and images is not None:
        try:
            return content_text(content, f"{where}.content", images, media)
        except InputError as err:
            raise RequestError(str(err), f"{where}.content") from err
    what = "text parts" if images is None else "text and image_url parts"
    raise RequestError(f"{where}.content must be a string or a list of {what}", f"{where}.content")


def hermes_call(name: str, arguments: Any) -> str:
    """A tool call as the Hermes text a model writes (for calls this server did not issue)."""
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    return f"{OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CLOSE}"


def template_messages(
    messages: Any, raw_replies: dict[str, str], images: list[bytes] | None = None, media: str | None = None
) -> Messages:
    """OpenAI messages as the chat template takes them: every content a string; an assistant turn with
    ``tool_calls`` as the text the model wrote (``raw_replies``: call id -> text) or, for calls this server
    did not issue, Hermes tool-call text. ``images`` (a vision-language model's server): gets each
    ``image_url`` part's image, the part an ``<image>`` marker (``_content_text``)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise RequestError(
                f"{where} must be an object with a role of system, developer, user, assistant or tool", where
            )
        role = "system" if message["role"] == "developer" else message["role"]
        text = _content_text(message.get("content"), where, images, media)
        calls = message.get("tool_calls") or []
        if role == "assistant" and calls:
            ids = [c.get("id") for c in calls if isinstance(c, dict)]
            if ids and ids[0] in raw_replies:
                text = raw_replies[ids[0]]
            else:
                try:
                    text = (text + "\n" if text else "") + "\n".join(
                        hermes_call(c["function"]["name"], c["function"].get("arguments", {})) for c in calls
                    )
                except (KeyError, TypeError, json.JSONDecodeError) as err:
                    raise RequestError(
                        f"{where}.tool_calls is malformed: {err}", f"{where}.tool_calls"
                    ) from err
        out.append({"role": role, "content": text})
    return out


def with_tools_in_system(messages: Messages, tools: list[dict[str, Any]]) -> Messages:
    """``messages`` with the tool schemas described in the system message (one is added if none)."""
    described = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
    if messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + described}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]


def assistant_message(text: str, parse_tools: bool) -> tuple[dict[str, Any], str | None]:
    """The OpenAI message for what the model wrote, and ``tool_calls`` as the finish reason when it called
    tools (malformed calls stay in the content, as text)."""
    calls = [c for c in parse_tool_calls(text) if c.error is None] if parse_tools else []
    if not calls:
        return {"role": "assistant", "content": text}, None
    content = text[: text.find(OPEN)].strip()  # Hermes: any prose comes before the calls
    tool_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in calls
    ]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, "tool_calls"


def envelope(kind: str, model: str, choices: list[dict], usage: dict, version: int) -> dict[str, Any]:
    """A response object with its id, creation time and the weight version that produced it."""
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        "weight_version": version,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The token counts of a response."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_list(names: list[str]) -> dict[str, Any]:
    """``GET /v1/models``: every name the server answers to."""
    created = int(time.time())
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": created, "owned_by": "hybridflow"} for n in names],
    }


def token_logprobs(text: TokenText, token_ids: list[int], log_probs: list[float]) -> list[dict[str, Any]]:
    """A chat choice's ``logprobs.content``: each sampled token's string, log-prob and raw UTF-8 ``bytes``
    (joined, the completion's bytes, also where a character spans tokens); no alternatives."""
    return [
        {"token": text.token_string(t), "logprob": lp, "bytes": list(text.token_bytes(t)), "top_logprobs": []}
        for t, lp in zip(token_ids, log_probs)
    ]


def legacy_logprobs(text: TokenText, token_ids: list[int], log_probs: list[float]) -> dict[str, Any]:
    """A text completion's ``logprobs``: token strings, their log-probs and ``text_offset``, the character
    where each token starts in the text (a token that starts inside a character: that character's)."""
    ends = text.char_ends(token_ids)
    return {
        "tokens": [text.token_string(t) for t in token_ids],
        "token_logprobs": log_probs,
        "top_logprobs": None,
        "text_offset": [0, *ends[:-1]] if ends else [],
    }


def chat_chunks(out: dict[str, Any], pieces: list[list[str]], include_usage: bool) -> list[dict[str, Any]]:
    """A finished chat answer as ``chat.completion.chunk`` events: per choice the role, the content in
    ``pieces`` (one list per choice), the tool calls and the finish reason; then the usage if asked for."""
    head = {k: out[k] for k in ("id", "created", "model", "weight_version")} | {
        "object": "chat.completion.chunk"
    }

    def chunk(index: int, delta: dict, finish: str | None = None) -> dict[str, Any]:
        """One event: choice ``index``'s ``delta``."""
        return {**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}

    events = []
    for choice, texts in zip(out["choices"], pieces):
        i, message = choice["index"], choice["message"]
        events.append(chunk(i, {"role": "assistant", "content": ""}))
        events += [chunk(i, {"content": piece}) for piece in texts]
        if message.get("tool_calls"):
            events.append(
                chunk(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]})
            )
        events.append(chunk(i, {}, choice["finish_reason"]))
    if include_usage:
        events.append({**head, "choices": [], "usage": out["usage"]})
    return events


def completion_chunks(out: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished text completion as events, one per choice."""
    head = {k: out[k] for k in ("id", "object", "created", "model", "weight_version")}
    return [
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


def generation_body(model: str, prompt_ids: list[int], choices: list[dict], version: int) -> dict[str, Any]:
    """``POST /v1/generate``'s answer: the prompt ids and, per sample, its ids, log-probs, text and finish."""
    return {
        "id": f"gen-{uuid.uuid4().hex}",
        "object": "generation",
        "model": model,
        "prompt_ids": prompt_ids,
        "choices": choices,
        "weight_version": version,
    }
