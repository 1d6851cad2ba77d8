"""The multi-turn agent loop with an image prompt: a tiny VLM taught (by the SFT trainer, on an image row) to
call the calculator then answer; the picture goes with every turn, and the multi-turn rows score as the
model scores them alone."""

import base64
import io
import json

import pytest
import torch
from PIL import Image

from hybridflow.config.offline import SFTConfig, load_offline_config
from hybridflow.config.schema import MultiTurnConfig, RolloutConfig
from hybridflow.data.dataset import RLHFDataset
from hybridflow.data.loader import collate_fn
from hybridflow.tools import CalculatorTool
from hybridflow.trainer.offline import OfflineTrainer
from hybridflow.workers.modeling import load_image_prompts, load_model, load_tokenizer, response_log_probs
from hybridflow.workers.rollout import AgentLoop, HFRollout

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "4*3"}}</tool_call>'
QUESTION = {"role": "user", "content": "<image>How many sides has the red square, times 3?"}
CHAT = [
    QUESTION,
    {"role": "assistant", "content": CALL},
    {"role": "tool", "content": "12"},
    {"role": "assistant", "content": "12"},
]


@pytest.fixture(scope="module")
def taught(tiny_vlm, tmp_path_factory):
    """The tiny Qwen2-VL after 60 SFT steps on the image chat (loss about 0.005)."""
    out = tmp_path_factory.mktemp("vision_agent")
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), (220, 30, 30)).save(buffer, format="PNG")
    images = [{"bytes": base64.b64encode(buffer.getvalue()).decode()}]
    (out / "sft.jsonl").write_text((json.dumps({"messages": CHAT, "images": images}) + "\n") * 4)
    (out / "rl.jsonl").write_text(json.dumps({"prompt": [QUESTION], "images": images}) + "\n")
    config = load_offline_config(
        SFTConfig,
        [
            f"data.train_files={out / 'sft.jsonl'}",
            f"model.partial_pretrain={tiny_vlm('qwen2_vl')}",
            f"trainer.default_local_dir={out / 'run'}",
            "data.train_batch_size=4",
            "data.micro_batch_size_per_gpu=4",
            "data.max_length=160",
            "optim.lr=1e-2",
            "trainer.total_training_steps=60",
            "trainer.logger=[file]",
        ],
    )
    with OfflineTrainer(config) as trainer:
        trainer.fit()
    return out / "run" / "global_step_60" / "actor" / "huggingface", out / "rl.jsonl"


def test_an_image_prompt_goes_with_every_turn_of_the_agent_loop(taught, plain_log_probs):
    folder, data = taught
    tokenizer = load_tokenizer(str(folder))
    prompts = collate_fn(
        [RLHFDataset(data, tokenizer, 64, processor=load_image_prompts(str(folder), tokenizer))[0]]
    )
    model = load_model(str(folder), torch.device("cpu")).eval()
    engine = HFRollout(model, tokenizer, RolloutConfig(do_sample=True, temperature=0.5, top_k=0), 96, seed=0)
    loop = AgentLoop(
        engine,
        tokenizer,
        MultiTurnConfig(enable=True, max_assistant_turns=3),
        96,
        {"calculator": CalculatorTool()},
    )
    prompts.meta_info["n"] = 2
    out = loop.generate_sequences(prompts)
    assert list(out.non_tensor_batch["num_turns"]) == [2, 2]
    assert [m["content"] for m in out.non_tensor_batch["messages"][0][1:]] == [CALL, "12", "12"]
    assert len(out.non_tensor_batch["image_inputs"][1]) == 1
    with torch.no_grad():
        sampled, _ = response_log_probs(model, out, temperature=0.5)
        trainer, _ = response_log_probs(model, out)
    written = out.batch["response_mask"].bool()
    assert (sampled - out.batch["rollout_log_probs"])[written].abs().max() < 1e-5
    attended = out.batch["attention_mask"][:, -out.batch["responses"].shape[1] :].bool()
    for r, plain in enumerate(plain_log_probs(model, out)):  # tool output included: what the model attends to
        assert torch.allclose(trainer[r][attended[r]], plain, atol=1e-5)
