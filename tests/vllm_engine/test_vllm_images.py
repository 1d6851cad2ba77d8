"""vLLM and vision-language models on this CPU build: vLLM's own vision models do not import without
torchvision (which does not load beside the local torch), so the vLLM rollout refuses a vision-language model
with one line pointing at rollout.name=hf. When either import starts to work, this test says so."""

import importlib
import json

import pytest
import torch

from hybridflow.config.schema import RolloutConfig
from hybridflow.utils.errors import UserError
from hybridflow.workers.rollout.vllm_rollout import VLLMRollout


@pytest.mark.parametrize("module", ["qwen2_vl", "qwen2_5_vl", "llava"])
def test_vllms_vision_models_need_torchvision_here(module):
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        importlib.import_module(f"vllm.model_executor.models.{module}")


def test_the_vllm_rollout_refuses_a_vision_language_model(tmp_path, tiny_model_path):
    from hybridflow.workers.modeling import load_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    with pytest.raises(
        UserError, match="rollout.name=vllm does not take vision-language models.*rollout.name=hf"
    ):
        VLLMRollout(
            str(tmp_path),
            load_tokenizer(tiny_model_path),
            RolloutConfig(),
            8,
            64,
            torch.float32,
            torch.device("cpu"),
            0,
        )
