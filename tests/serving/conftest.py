"""A real ``hybridflow serve`` process on a tiny model taught to call a calculator, and its ``openai`` client."""

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hybridflow.models.tiny import make_tiny_model, teach_conversations
from hybridflow.serving.openai_format import with_tools_in_system

REPO = Path(__file__).resolve().parents[2]
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
QUESTION = [{"role": "user", "content": "Compute 12*34."}]
CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
TOOL_CHAT = [
    *QUESTION,
    {"role": "assistant", "content": CALL_TEXT},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "12*34=408"},
]


@pytest.fixture(scope="session")
def taught_model(tmp_path_factory) -> str:
    """The tiny model after a few seconds of supervised steps on the calculator chat as the server renders
    it (the tool described in the system message), so real generations call the tool and answer."""
    torch.set_num_threads(1)
    folder = make_tiny_model(tmp_path_factory.mktemp("served-model") / "model")
    chat = with_tools_in_system(TOOL_CHAT, [CALCULATOR])
    plain = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    return teach_conversations(folder, [chat, plain])


def start_server(model: str, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``hybridflow serve`` on a free port; returns the process and its base URL once it answers."""
    process = subprocess.Popen(
        [sys.executable, "-m", "hybridflow.commands.cli", "serve", "--model", model, "--port", "0", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    if " at http" not in line:
        process.kill()
        raise AssertionError(f"the server did not start: {line!r} {process.stderr.read()[-2000:]}")
    return process, line.rsplit(" at ", 1)[1].strip()


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="session")
def server(taught_model) -> Iterator[str]:
    process, url = start_server(taught_model, "--max-tokens", "96")
    yield url
    stop(process)


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


def post(
    url: str, body: bytes | dict, token: str | None = None, headers: dict | None = None
) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a raw POST, for requests the SDK would refuse to send; ``headers``
    replace or add to the JSON content type (and the token's authorization)."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    headers = {"Content-Type": "application/json", **auth, **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    start = time.time()
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        assert time.time() - start < 120
        return error.code, json.loads(error.read()), dict(error.headers)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """The arithmetic task: 64 training and 8 test prompts (parquet), seeded."""
    from hybridflow.data.prepare import main as prepare_data

    out = tmp_path_factory.mktemp("arith")
    prepare_data(["arithmetic", str(out), "--train-size", "64", "--test-size", "8", "--seed", "0"])
    return out
