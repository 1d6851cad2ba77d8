"""``hybridflow make-tiny-model --vlm FAMILY``: tiny random vision-language models that the plain transformers
classes load, whose tokenizer and processor expand images into the tokens the model takes."""

import json
import time

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from hybridflow.data.images import ImagePrompts, decode_image
from hybridflow.models.tiny import main
from hybridflow.models.vision import model_image_inputs

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"]


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_builds_a_vlm_in_seconds_that_auto_classes_load(tmp_path, family, capsys):
    start = time.perf_counter()
    assert main([str(tmp_path), "--vlm", family]) == 0
    assert time.perf_counter() - start < 10
    assert f"wrote tiny {family} model" in capsys.readouterr().out
    model = AutoModelForImageTextToText.from_pretrained(tmp_path)
    assert model.config.model_type == family
    assert sum(p.numel() for p in model.parameters()) < 400_000
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(model.config.image_token_id)) == (
        model.config.image_token_id
    )
    assert json.loads((tmp_path / "processor_config.json").read_text())["processor_class"].endswith(
        "Processor"
    )
    assert type(AutoImageProcessor.from_pretrained(tmp_path)).__name__.endswith("Pil")  # no torchvision here
    prompts = ImagePrompts.from_pretrained(str(tmp_path), tokenizer)
    image = prompts.image_input(*decode_image(Image.new("RGB", (60, 40), (0, 200, 0)), "test"))
    ids = prompts.encode([{"role": "user", "content": "<image>Which colour?"}], (image,), "test")
    assert ids.count(model.config.image_token_id) == image.num_tokens > 1
    # the model takes those tokens with the image's arrays (it checks that the counts agree)
    inputs = torch.tensor([ids])
    kwargs = model_image_inputs([image], "cpu")
    if family != "llava":
        kwargs["mm_token_type_ids"] = (inputs == model.config.image_token_id).int()
    out = model.generate(input_ids=inputs, **kwargs, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, len(ids) + 3)


def test_llava_processor_loads_with_auto_processor_and_expands_as_hybridflow_does(tiny_vlm):
    folder = tiny_vlm("llava")
    processor = AutoProcessor.from_pretrained(folder)
    image, data = decode_image(Image.new("RGB", (50, 70), (10, 20, 200)), "test")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    theirs = processor(text=[text], images=[[image]], return_tensors="np")
    ours = ImagePrompts.from_pretrained(folder, processor.tokenizer)
    item = ours.image_input(image, data)
    assert (
        ours.encode([{"role": "user", "content": "<image>Colour?"}], (item,), "t")
        == theirs["input_ids"][0].tolist()
    )
    assert (item.arrays["pixel_values"] == theirs["pixel_values"]).all()


def test_qwen_processor_needs_torchvision_here(tiny_vlm):
    """Why hybridflow reads the image processor alone: AutoProcessor also builds Qwen's video processor."""
    with pytest.raises(ImportError, match="[Tt]orchvision"):
        AutoProcessor.from_pretrained(tiny_vlm("qwen2_vl"))
