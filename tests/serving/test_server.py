"""``hybridflow serve`` answering the real ``openai`` client: chat, tools, n, log-probs equal to the
trainer's, streaming, errors, auth, the token endpoint and batching across concurrent sessions."""

import asyncio
import json
import os
import subprocess
import sys

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.protocol import DataProto
from hybridflow.workers.modeling import response_log_probs
from tests.serving.conftest import CALCULATOR, QUESTION, REPO, post, start_server, stop

MODEL = "model"  # the served folder's name


def test_models_and_a_chat_carry_the_weight_version(client, taught_model):
    assert [m.id for m in client.models.list().data] == [MODEL]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=8
    )
    reply = raw.parse()
    assert reply.choices[0].message.content == "hi"  # what the tiny model was taught, greedily
    assert reply.choices[0].finish_reason == "stop"
    assert raw.headers["x-weight-version"] == "0" and reply.model_extra["weight_version"] == 0
    hi = AutoTokenizer.from_pretrained(taught_model)("hi", add_special_tokens=False)["input_ids"]
    assert reply.usage.completion_tokens == len(hi) + 1  # "hi" and the EOS that ended it


def test_tools_round_trip(client):
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[CALCULATOR], temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "12*34"}
    messages = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "408"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR], temperature=0)
    assert second.choices[0].message.content == "12*34=408"
    assert not second.choices[0].message.tool_calls


def test_n_samples(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], n=5, max_tokens=12, seed=3
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3, 4]
    assert len({c.message.content for c in reply.choices}) > 1  # sampled at temperature 1: not all alike


def test_logprobs_equal_the_trainers(client, taught_model):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=12,
        temperature=0.7,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    prompt = reply.model_extra["prompt_token_ids"]
    ids = reply.choices[0].model_extra["token_ids"]
    served = torch.tensor([t.logprob for t in reply.choices[0].logprobs.content])
    assert len(ids) == len(served) > 0
    model = AutoModelForCausalLM.from_pretrained(taught_model).eval()
    full = torch.tensor([prompt + ids])
    data = DataProto.from_dict(
        {
            "input_ids": full,
            "attention_mask": torch.ones_like(full),
            "position_ids": torch.arange(full.shape[1])[None],
            "responses": torch.tensor([ids]),
        }
    )
    with torch.no_grad():
        trainer, _ = response_log_probs(model, data, 0.7)
    torch.testing.assert_close(served, trainer[0], atol=1e-4, rtol=0)


def test_streaming_gives_the_same_answer(client):
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 16}
    whole = client.chat.completions.create(**ask, seed=11).choices[0].message.content
    chunks = list(client.chat.completions.create(**ask, seed=11, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == whole and len([p for p in pieces if p]) > 1
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = client.completions.create(model=MODEL, prompt="The quick", max_tokens=6, seed=2)
    streamed = client.completions.create(model=MODEL, prompt="The quick", max_tokens=6, seed=2, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_malformed_requests_get_400_with_a_message(client, server):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=5)
    assert error.value.status_code == 400 and "'temperature' must be a number in [0.0, 2.0]" in str(
        error.value
    )
    assert error.value.body["param"] == "temperature"
    status, body, _ = post(f"{server}/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body, _ = post(f"{server}/chat/completions", {"model": MODEL, "messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body, _ = post(f"{server}/nothing", {})
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    status, body, _ = post(f"{server}/chat/completions", {"model": "gpt-4o", "messages": QUESTION})
    assert status == 404 and body["error"]["code"] == "model_not_found"  # /v1/models lists only MODEL
    status, body, _ = post(f"{server}/chat/completions", b"{}", headers={"Content-Type": "text/plain"})
    assert status == 415


def test_token_in_token_out(client, server):
    prompt = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=1, extra_body={"return_token_ids": True}
    ).model_extra["prompt_token_ids"]
    status, body, headers = post(f"{server}/generate", {"prompt_ids": prompt, "max_tokens": 4, "n": 2})
    assert status == 200 and headers["X-Weight-Version"] == "0" and body["weight_version"] == 0
    assert [len(c["token_ids"]) for c in body["choices"]] == [len(c["logprobs"]) for c in body["choices"]]
    assert all(0 < len(c["token_ids"]) <= 4 for c in body["choices"])


def test_a_non_loopback_bind_needs_the_token(taught_model):
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow.commands.cli",
            "serve",
            "--model",
            taught_model,
            "--host",
            "0.0.0.0",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HYBRIDFLOW_SERVE_TOKEN": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        refused.returncode == 2
        and "serving on 0.0.0.0 (not a loopback address) needs a token" in refused.stderr
    )
    process, url = start_server(taught_model, "--host", "0.0.0.0", "--token", "s3cret")
    try:
        url = url.replace("0.0.0.0", "127.0.0.1")
        anonymous = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as error:
            anonymous.models.list()
        assert error.value.status_code == 401
        assert post(f"{url}/completions", {"model": MODEL, "prompt": "a"})[0] == 401  # no header at all
        allowed = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert allowed.completions.create(model=MODEL, prompt="a", max_tokens=2).choices[0].text is not None
    finally:
        stop(process)


def test_32_concurrent_sessions_are_batched(server):
    before = post_metrics(server)

    async def session(client: openai.AsyncOpenAI, i: int) -> str:
        messages = [{"role": "user", "content": f"Compute {i}*2."}]
        first = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Again."},
        ]
        second = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
        return second.choices[0].finish_reason

    async def run_all() -> list[str]:
        base = server.removesuffix("/v1")
        clients = [
            openai.AsyncOpenAI(base_url=f"{base}/sessions/c{i}/v1", api_key="x", max_retries=0)
            for i in range(32)
        ]
        try:
            return await asyncio.gather(*(session(c, i) for i, c in enumerate(clients)))
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    reasons = asyncio.run(run_all())
    assert len(reasons) == 32 and set(reasons) <= {"stop", "length"}
    after = post_metrics(server)
    rows = after["batch_rows"][len(before["batch_rows"]) :]
    assert sum(rows) == 64  # every call generated once
    assert len(rows) < 64 and max(rows) > 1  # ... and together: fewer engine calls than calls


def post_metrics(server: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(server.removesuffix("/v1") + "/metrics", timeout=30) as response:
        return json.loads(response.read())
