"""Weights written and read one tensor at a time: files that safetensors and transformers read back exactly, split
over several files with an index past the shard size, as save_pretrained splits them; a folder read tensor by
tensor; models built with their parameters on the meta device but their buffers computed; and where rank 0 of
a sharded model takes its tensors from (the files when they hold the model's names, else the model loaded)."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from hybridflow.workers.modeling import parameters_on_meta, weights_source
from hybridflow.workers.weight_files import INDEX_NAME, WEIGHTS_NAME, SafetensorsFolder, StreamedSafetensors


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


def test_folder_reads_each_tensor_as_asked_from_one_file_or_an_index(tiny_model_path, tmp_path):
    state = load_file(f"{tiny_model_path}/{WEIGHTS_NAME}")
    files = SafetensorsFolder.open(tiny_model_path)
    assert set(files) == set(state) and "no.such.weight" not in files
    for name, tensor in state.items():
        assert files.shape(name) == tuple(tensor.shape) and torch.equal(files[name], tensor), name
    writer = StreamedSafetensors(tmp_path, [(k, v.dim()) for k, v in state.items()], max_shard_bytes=1)
    for name, tensor in state.items():
        writer.add(name, tensor)
    assert len(writer.close()) == len(state)  # one tensor a file
    split = SafetensorsFolder.open(tmp_path)
    assert all(torch.equal(split[name], tensor) for name, tensor in state.items())
    assert SafetensorsFolder.open(tmp_path / "missing") is None


def test_parameters_on_meta_keeps_the_buffers_the_model_computes(tiny_model_path):
    config = AutoConfig.from_pretrained(tiny_model_path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert all(p.device.type == "meta" for p in model.parameters())
    buffers = dict(model.named_buffers())
    assert buffers and buffers.keys() == dict(plain.named_buffers()).keys()
    for name, buffer in plain.named_buffers():  # rotary frequencies: no checkpoint holds them
        assert buffers[name].device.type == "cpu" and torch.equal(buffers[name], buffer), name
    assert SafetensorsFolder.open(tiny_model_path).holds(model)


def test_weights_source_streams_matching_files_and_loads_others_whole(tiny_model_path, tmp_path):
    config = AutoConfig.from_pretrained(tiny_model_path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    assert isinstance(weights_source(tiny_model_path)(model), SafetensorsFolder)
    # a checkpoint under other names (here: without the "model." prefix transformers adds back on loading)
    renamed = tmp_path / "renamed"
    shutil.copytree(tiny_model_path, renamed)
    state = load_file(renamed / WEIGHTS_NAME)
    save_file({k.removeprefix("model."): v for k, v in state.items()}, renamed / WEIGHTS_NAME)
    assert not SafetensorsFolder.open(renamed).holds(model)
    whole = weights_source(str(renamed))(model)
    assert isinstance(whole, dict)
    for name, tensor in AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict().items():
        assert torch.equal(whole[name], tensor), name
