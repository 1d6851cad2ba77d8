"""Fixtures shared by every test directory: a tiny model folder, prompt batches and a Ray session."""

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridflow import DataProto
from hybridflow.data.prepare import main as prepare_data

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Tiny models: thread overhead exceeds the work (20x slower on a busy CPU), so one thread unless OMP_NUM_THREADS
# asks for more (scripts/test_portable.sh runs the learning tests at 1 and 2: threads change reduction orders).
TORCH_THREADS = int(os.environ.get("OMP_NUM_THREADS") or 1)
torch.set_num_threads(TORCH_THREADS)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A random 2-layer Llama with a ~1k-token tokenizer (ChatML, eos = pad = <|im_end|>)."""
    from hybridflow.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _chat_prompts(tokenizer, questions: list[str], uids: list[str] | None = None) -> DataProto:
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    position_ids = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "position_ids": position_ids},
        {
            "uid": uids or [f"p{i}" for i in range(len(questions))],
            "raw_prompt": [[{"role": "user", "content": q}] for q in questions],
        },
    )


@pytest.fixture(scope="session")
def chat_prompts():
    """``chat_prompts(tokenizer, questions, uids=None)``: left-padded chat prompts as the dataset's
    collate would build them."""
    return _chat_prompts


@pytest.fixture(scope="session")
def ray_session():
    """Ray on 2 CPUs with its session files in a short temporary folder; shut down only if started here."""
    import ray

    from hybridflow.single_controller.ray import init_ray

    if ray.is_initialized():
        yield
        return
    temp_dir = tempfile.mkdtemp(prefix="hfray-")  # short: Ray's socket paths inside must stay < 107 chars
    started = init_ray(num_cpus=2, _temp_dir=temp_dir)
    yield
    if started:
        ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


# tests/vllm_engine need vLLM's CPU build, which lives in its own environment (`make test-vllm`, README: vLLM
# rollout); the core environment does not collect them, and `make test-vllm` runs them there.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_engine"]


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory) -> Callable[[int, int], Path]:
    """``arithmetic_data(train_size, test_size)``: a folder with the arithmetic task's train.parquet and
    test.parquet, seeded."""

    def make(train_size: int, test_size: int) -> Path:
        out = tmp_path_factory.mktemp("arith")
        prepare_data(
            [
                "arithmetic",
                str(out),
                "--train-size",
                str(train_size),
                "--test-size",
                str(test_size),
                "--seed",
                "0",
            ]
        )
        return out

    return make


@pytest.fixture(scope="module")
def data_dir(arithmetic_data) -> Path:
    """The arithmetic task: 64 training and 8 test prompts (parquet), seeded."""
    return arithmetic_data(64, 8)


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Callable[[str], str]:
    """``tiny_vlm(family)``: the folder of a tiny random vision-language model of ``family`` (qwen2_vl,
    qwen2_5_vl, qwen3_vl, llava), built once per session."""
    from hybridflow.models.tiny import make_tiny_vlm

    built: dict[str, str] = {}

    def make(family: str = "qwen2_vl") -> str:
        if family not in built:
            built[family] = make_tiny_vlm(tmp_path_factory.mktemp(family) / "model", family)
        return built[family]

    return make


def _plain_log_probs(model, data: DataProto, grad: bool = False) -> list[torch.Tensor]:
    """Each row of a rollout-laid-out batch alone through the model's own forward, the model computing its own
    positions (Qwen's 3-D ones from ``mm_token_type_ids`` and the images): the log-probs of the row's response
    tokens (image placeholders never written), one tensor per row. What every optimised path (packing,
    batching, the rollout's cache) must equal."""
    from hybridflow.models.vision import model_image_inputs, placeholder_token_ids, without_placeholders

    length = data.batch["responses"].shape[1]
    images = data.non_tensor_batch.get("image_inputs", [()] * len(data))
    out = []
    for r in range(len(data)):
        mask = data.batch["attention_mask"][r].bool()
        prompt = data.batch["input_ids"][r, :-length][mask[:-length]]
        response = data.batch["responses"][r][mask[-length:]]
        ids = torch.cat([prompt, response])[None]
        kwargs = model_image_inputs(list(images[r]), "cpu")
        if "image_grid_thw" in kwargs:
            kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=ids, **kwargs).logits[0].float()
        logits = without_placeholders(logits, placeholder_token_ids(model.config)).log_softmax(-1)
        steps = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
        out.append(logits[steps, response])
    return out


@pytest.fixture(scope="session")
def plain_log_probs():
    """``plain_log_probs(model, data, grad=False)``: per row, the response's log-probs from the model's own
    forward of that row alone (see ``_plain_log_probs``)."""
    return _plain_log_probs
