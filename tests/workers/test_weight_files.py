"""Safetensors written one tensor at a time: files that safetensors and transformers read back exactly, split
over several files with an index past the shard size, as save_pretrained splits them."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hybridflow.workers.weight_files import INDEX_NAME, WEIGHTS_NAME, StreamedSafetensors


def test_streamed_file_reads_back_every_dtype_and_shape(tmp_path):
    tensors = {
        "a.weight": torch.randn(3, 5),
        "b.bf16": torch.randn(7).to(torch.bfloat16),
        "c.ids": torch.arange(12, dtype=torch.int64).reshape(2, 2, 3),
        "d.mask": torch.tensor([True, False, True]),
        "e.scalar": torch.tensor(2.5, dtype=torch.float16),
        "f.empty": torch.zeros(0, 4),
        "g.view": torch.randn(6, 6).t(),  # not contiguous
    }
    writer = StreamedSafetensors(tmp_path, [(name, t.dim()) for name, t in tensors.items()])
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    assert writer.close() == [tmp_path / WEIGHTS_NAME]
    loaded = load_file(tmp_path / WEIGHTS_NAME)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(tmp_path / WEIGHTS_NAME, "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_model_split_over_files_loads_with_its_index(tiny_model_path, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.save_pretrained(tmp_path, state_dict={})  # config and generation config, no weights
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    largest = max(t.numel() * t.element_size() for t in state.values())
    writer = StreamedSafetensors(tmp_path, [(k, v.dim()) for k, v in state.items()], max_shard_bytes=largest)
    for name, tensor in state.items():
        writer.add(name, tensor)
    files = writer.close()
    assert len(files) > 2 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / WEIGHTS_NAME).exists() and not list(tmp_path.glob(".part*"))
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["weight_map"].keys() == state.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    for path in files:  # no file but one holding a single tensor exceeds the limit
        sizes = [t.numel() * t.element_size() for t in load_file(path).values()]
        assert sum(sizes) <= largest or len(sizes) == 1
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_a_header_longer_than_expected_is_refused(tmp_path):
    writer = StreamedSafetensors(tmp_path, [("w", 1)])
    writer.add("a_name_much_longer_than_the_one_expected_" * 4, torch.zeros(2))
    with pytest.raises(ValueError, match="exceeds the"):
        writer.close()
