"""``hybridflow serve`` on a vision-language model: OpenAI ``image_url`` parts as ``data:`` URLs, local files
only inside ``--allowed-local-media-path``, never a network fetch; and GRPO training an ``openai`` SDK agent
that sends the row's picture."""

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from hybridflow.data.prepare import main as prepare_data
from hybridflow.serving.openai_format import RequestError, template_messages
from hybridflow.trainer import PPOTrainer, load_config

from .conftest import start_server, stop


def png(colour=(220, 30, 30), size=(56, 56)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def ask(url: str, text: str = "Which colour?") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
        }
    ]


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "red.png").write_bytes(png())
    return folder


@pytest.fixture(scope="module")
def vlm_server(tiny_vlm, media):
    process, url = start_server(
        tiny_vlm("qwen2_vl"),
        "--max-tokens",
        "8",
        "--allowed-local-media-path",
        str(media),
        "--name",
        "policy",
    )
    yield url
    stop(process)


def test_image_url_parts_reach_the_model_as_its_image_tokens(vlm_server, media, tiny_vlm):
    import openai
    from transformers import AutoConfig

    image_token = AutoConfig.from_pretrained(tiny_vlm("qwen2_vl")).image_token_id
    client = openai.OpenAI(base_url=vlm_server, api_key="unused", max_retries=0)
    data_url = "data:image/png;base64," + base64.b64encode(png()).decode()
    kwargs = {"model": "policy", "max_tokens": 3, "temperature": 0, "extra_body": {"return_token_ids": True}}
    by_data = client.chat.completions.create(messages=ask(data_url), **kwargs)
    by_file = client.chat.completions.create(messages=ask(str(media / "red.png")), **kwargs)
    blue = client.chat.completions.create(
        messages=ask("data:image/png;base64," + base64.b64encode(png((0, 0, 255))).decode()), **kwargs
    )
    ids = by_data.model_extra["prompt_token_ids"]
    assert ids == by_file.model_extra["prompt_token_ids"]  # the same picture, sent either way
    assert by_data.usage.prompt_tokens == len(ids) and ids.count(image_token) == 4  # 56 px: 4 image tokens
    assert by_data.choices[0].message.content == by_file.choices[0].message.content
    assert blue.model_extra["prompt_token_ids"] == ids  # same size: the same tokens; the pixels differ
    with pytest.raises(openai.BadRequestError, match="not fetched"):
        client.chat.completions.create(messages=ask("https://example.com/cat.png"), **kwargs)
    with pytest.raises(openai.BadRequestError, match="outside --allowed-local-media-path"):
        client.chat.completions.create(messages=ask("/etc/hostname"), **kwargs)
    with pytest.raises(openai.BadRequestError, match="cannot be decoded"):
        client.chat.completions.create(
            messages=ask("data:image/png;base64," + base64.b64encode(b"junk").decode()), **kwargs
        )


def test_a_text_model_server_refuses_image_parts():
    """A server without a processor (a text model) reads messages with images=None."""
    with pytest.raises(RequestError, match=r"messages\[0\].content must be a string or a list of text parts"):
        template_messages(ask("data:image/png;base64,AAAA"), {}, None)
    pictures: list[bytes] = []
    assert template_messages(ask("data:image/png;base64,AAAA"), {}, pictures) == [
        {"role": "user", "content": "<image>Which colour?"}
    ]
    assert pictures == [base64.b64decode("AAAA")]


AGENT = '''
async def run(client, sample):
    """Show the row's picture, ask its question; reward by the shapes rule, and a varied text bonus."""
    question = sample["messages"][-1]["content"].replace("<image>", "")
    content = [{"type": "image_url", "image_url": {"url": sample["image_urls"][0]}}, {"type": "text", "text": question}]
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": content}], max_tokens=4)
    text = reply.choices[0].message.content
    return float(text.strip().startswith(sample["reward_model"]["ground_truth"])) + sum(map(ord, text)) % 5 / 10
'''


def test_grpo_trains_an_sdk_agent_that_sends_the_rows_picture(tiny_vlm, tmp_path):
    prepare_data(["shapes", str(tmp_path / "data"), "--train-size", "8", "--test-size", "2"])
    (tmp_path / "agent.py").write_text(AGENT)
    cfg = load_config(
        [
            f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
            f"actor_rollout_ref.model.path={tiny_vlm('qwen2_vl')}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"actor_rollout_ref.rollout.served_agent.path={tmp_path / 'agent.py'}",
            "algorithm.adv_estimator=grpo",
            "data.max_prompt_length=64",
            "data.max_response_length=8",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "trainer.logger=[file]",
        ]
    )
    batches = []
    with PPOTrainer(cfg) as trainer:
        trainer.register_hook("after_reward", lambda t, step, metrics, batch: batches.append(batch))
        trainer.fit()
    first = batches[0]
    assert len(first) == 8 and all(len(images) == 1 for images in first.non_tensor_batch["image_inputs"])
    # each row's picture is the one its data row holds (the agent sent it as a data: URL)
    keys = [images[0].key for images in first.non_tensor_batch["image_inputs"]]
    assert len(set(keys)) == 4
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "timing_s/step" in row]
    assert len(steps) == 2 and all(row["rollout/logprob_diff"] < 1e-4 for row in steps)
    assert all(row["actor/grad_norm"] > 0 for row in steps) and torch.isfinite(
        torch.tensor(steps[-1]["actor/pg_loss"])
    )
