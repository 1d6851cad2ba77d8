"""The server's wire format on text whose characters span tokens, and who may call it: a scripted engine
behind a real ``PolicyServer``, asked by the real ``openai`` client and by raw HTTP.

The tiny model's tokenizer is byte-level: every Cyrillic letter is two tokens, CJK characters and the emoji
three or four, so decoding a token alone gives U+FFFD. The log-probs' ``bytes`` must be each token's own bytes
(joined: the completion, byte for byte), ``text_offset`` the character each token starts in, the stream's
chunks the text cut at character boundaries, found in one pass over the tokens."""

import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.commands.serve import _parser
from hybridflow.config.schema import RolloutConfig
from hybridflow.protocol import DataProto
from hybridflow.rollout import Rollout, SamplingParams, assemble_rollout
from hybridflow.serving import PolicyServer
from hybridflow.serving.token_text import TokenText
from tests.serving.conftest import post

TEXT = "Здравствуй, 你好 🙂!"


class Scripted(Rollout):
    """Writes ``TEXT`` (then EOS) for every prompt, whatever the sampling; log-prob -0.5 a token."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, [tokenizer.eos_token_id]
        self.ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"] + self.eos_token_ids

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        params = SamplingParams.from_config(RolloutConfig(), 8, prompts.meta_info)
        rows, length = prompts.repeat(params.n, interleave=True), params.response_length
        responses = torch.full((len(rows), length), self.tokenizer.pad_token_id)
        responses[:, : min(length, len(self.ids))] = torch.tensor(self.ids[:length])
        log_probs = torch.full(responses.shape, -0.5)
        return assemble_rollout(rows, responses, log_probs, self.eos_token_ids, self.tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _serve(tokenizer, names, token=None) -> Iterator[str]:
    server = PolicyServer(
        Scripted(tokenizer), tokenizer, names, token=token, max_tokens_limit=64, window_s=0.0
    )
    url = server.start_in_thread()
    yield url
    server.stop_thread()


@pytest.fixture(scope="module")
def url(tokenizer) -> Iterator[str]:
    yield from _serve(tokenizer, ["policy", "gpt-4o-mini"])


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)


def test_the_text_spans_tokens(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    alone = [tokenizer.decode([i]) for i in ids]
    assert len(ids) > len(TEXT) and sum("\ufffd" in t for t in alone) >= 10  # what broke the old bytes


def test_chat_logprob_bytes_join_to_the_completion(client):
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], logprobs=True
    )
    content = reply.choices[0].message.content
    tokens = reply.choices[0].logprobs.content
    assert content == TEXT
    assert (
        b"".join(bytes(t.bytes) for t in tokens) == TEXT.encode() + b"<|im_end|>"
    )  # the EOS is a sampled token
    assert [t.logprob for t in tokens] == [-0.5] * len(tokens)
    partial = [t for t in tokens if t.token.startswith("bytes:")]
    assert len(partial) >= 10  # parts of characters, written as OpenAI writes them
    first = tokens[0]  # the first byte of 'З' (D0 97)
    assert first.bytes == [0xD0] and first.token == "bytes:\\xd0"


def test_completion_text_offsets_are_characters(client):
    reply = client.completions.create(model="policy", prompt="hi", max_tokens=40, logprobs=0)
    choice = reply.choices[0]
    assert choice.text == TEXT
    offsets, tokens = choice.logprobs.text_offset, choice.logprobs.tokens
    assert offsets == sorted(offsets) and offsets[0] == 0 and len(offsets) == len(tokens)
    text = TEXT + "<|im_end|>"
    for offset, token in zip(offsets, tokens):
        if not token.startswith("bytes:"):  # a whole token starts where its text is
            assert text[offset:].startswith(token)
    # 'З' is tokens 0 and 1, 'д' tokens 2 and 3: both halves of a letter point at it
    assert offsets[:4] == [0, 0, 1, 1]


def test_the_stream_cuts_at_characters_in_one_pass(client, tokenizer, url, monkeypatch):
    stream = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == TEXT and not any("\ufffd" in p for p in pieces)
    assert len(pieces) == len(TEXT)  # one chunk per character here: each completes at a token
    decoded = []  # tokens passed to the tokenizer's decode, to cut a 400-token sample into pieces
    text = TokenText(tokenizer)
    ids = tokenizer(TEXT * 20, add_special_tokens=False)["input_ids"]
    original = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda t, **kw: decoded.append(len(t)) or original(t, **kw))
    assert "".join(text.pieces(ids, TEXT * 20)) == TEXT * 20
    assert sum(decoded) <= len(ids)  # no decoding of every prefix (the old cut decoded ~n^2/2 tokens)


def _raw(url: str, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_only_json_bodies_are_answered(url):
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    status, body, _ = post(
        f"{url}/chat/completions", json.dumps(chat).encode(), headers={"Content-Type": "text/plain"}
    )
    assert status == 415 and body["error"]["code"] == "unsupported_media_type"
    assert "text/plain" in body["error"]["message"]
    for kind in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        assert (
            post(f"{url}/completions", {"model": "policy", "prompt": "a"}, headers={"Content-Type": kind})[0]
            == 415
        )
    charset = {"Content-Type": "application/json; charset=utf-8"}
    assert post(f"{url}/completions", {"model": "policy", "prompt": "a"}, headers=charset)[0] == 200


def test_a_web_page_is_refused_without_a_token(url, tokenizer):
    body = {"model": "policy", "prompt": "a", "max_tokens": 2}
    status, error, _ = post(f"{url}/completions", body, headers={"Origin": "https://evil.example"})
    assert status == 403 and error["error"]["code"] == "origin_not_allowed"
    assert _raw(f"{url}/models", {"Origin": "http://192.168.1.5:8080"})[0] == 403
    assert post(f"{url}/completions", body, headers={"Origin": "http://localhost:3000"})[0] == 200
    assert post(f"{url}/completions", body, headers={"Origin": "http://127.0.0.1:5173"})[0] == 200
    for served in _serve(tokenizer, "policy", token="s3cret"):  # a token decides instead, whatever the origin
        assert post(f"{served}/completions", body, "s3cret", {"Origin": "https://app.example"})[0] == 200
        assert post(f"{served}/completions", body, None, {"Origin": "https://app.example"})[0] == 401


def test_an_unknown_model_is_404_and_aliases_are_served(client, url):
    assert [m.id for m in client.models.list().data] == ["policy", "gpt-4o-mini"]
    reply = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert reply.model == "gpt-4o-mini" and reply.choices[0].message.content == TEXT
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    error = raised.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'gpt-5' does not exist" in error["message"] and "'policy', 'gpt-4o-mini'" in error["message"]
    sessions = openai.OpenAI(base_url=url.removesuffix("/v1") + "/sessions/s1/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):  # a served agent's session follows the same rule
        sessions.completions.create(model="gpt-5", prompt="a")
    status, body, _ = post(
        f"{url}/generate", {"prompt_ids": [5, 6], "max_tokens": 2}
    )  # the token route: optional
    assert status == 200 and body["model"] == "policy"
    assert post(f"{url}/generate", {"model": "gpt-5", "prompt_ids": [5, 6]})[0] == 404


def test_serve_takes_vllms_alias_flag():
    args = _parser().parse_args(["--model", "m", "--served-model-name", "qwen", "Qwen/Qwen2.5-7B-Instruct"])
    assert args.served_model_name == ["qwen", "Qwen/Qwen2.5-7B-Instruct"]
    assert _parser().parse_args(["--model", "m", "--name", "old"]).served_model_name == ["old"]
    assert _parser().parse_args(["--model", "m"]).batch_window_ms == 10.0  # the schema's default
