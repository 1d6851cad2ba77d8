"""Scoring rows with images: packed as prefix trees or not, batched or one micro-batch at a time, with a token
budget or not, the log-probs (1e-5) and gradients (1e-4) are those of a plain forward of each row alone, in
which the model computes its own positions (Qwen's 3-D ones from the images) through its processor inputs."""

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from hybridflow.data.images import ImagePrompts, decode_image
from hybridflow.data.offline import Sample, collate_samples
from hybridflow.workers.modeling import response_log_probs
from hybridflow.workers.packing import MicroBatching, batched, pack_prefix_tree
from hybridflow.workers.row_layouts import image_inputs

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"]


def picture(colour, size=(56, 56)):
    image = Image.new("RGB", size, colour)
    for x in range(0, size[0], 5):
        image.putpixel((x, (3 * x) % size[1]), (0, 0, 0))
    return decode_image(image, "test")


def image_batch(folder):
    """Two samples of one image prompt (a GRPO group), the same image after other text, a prompt with two
    images (the first shared with the group's prefix), a text-only prompt: laid out as rollouts."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = ImagePrompts.from_pretrained(folder, tokenizer)
    red, blue = (
        prompts.image_input(*picture((255, 0, 0))),
        prompts.image_input(*picture((0, 0, 255), (84, 56))),
    )
    rows = [
        ("<image>How many shapes?", (red,)),
        ("<image>How many shapes?", (red,)),
        ("Look: <image> what colour?", (red,)),
        ("<image> and <image>: the same?", (red, blue)),
        ("plain text", ()),
    ]
    gen = torch.Generator().manual_seed(0)
    samples = []
    for text, images in rows:
        ids = prompts.encode([{"role": "user", "content": text}], images, "test")
        response = torch.randint(
            3, 900, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen
        ).tolist()
        samples.append(Sample(ids, response, [1] * len(response), images=images))
    return samples, collate_samples(samples, tokenizer.pad_token_id)


def as_rows(log_probs, samples):
    return [log_probs[i, : len(s.response)] for i, s in enumerate(samples)]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tiny_vlm):
    folder = tiny_vlm(request.param)
    model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="sdpa").eval()
    return request.param, folder, model


def test_log_probs_of_image_rows_match_a_plain_forward_row_by_row(family_model, plain_log_probs):
    family, folder, model = family_model
    samples, data = image_batch(folder)
    expected = plain_log_probs(model, data)
    with torch.no_grad():
        runs = {
            "packed": response_log_probs(model, data, share_prompt=True)[0],
            "unpacked": response_log_probs(model, data, share_prompt=False)[0],
            "2-row micro-batches": batched(
                lambda d: response_log_probs(model, d)[0], data, MicroBatching(2, share_prompt=True)
            ),
            "token budget": batched(
                lambda d: response_log_probs(model, d)[0], data, MicroBatching(1, 60, share_prompt=True)
            ),
        }
    for name, log_probs in runs.items():
        for r, (got, want) in enumerate(zip(as_rows(log_probs, samples), expected)):
            assert torch.allclose(got, want, atol=1e-5), (family, name, r, (got - want).abs().max())
    # the pixels matter: the first row with a green picture of the same size scores otherwise
    green = ImagePrompts.from_pretrained(folder, AutoTokenizer.from_pretrained(folder)).image_input(
        *picture((0, 255, 0))
    )
    other = collate_samples([Sample(samples[0].prompt, samples[0].response, [1], images=(green,))], 0)
    assert not torch.allclose(plain_log_probs(model, other)[0], expected[0], atol=1e-4)


def test_packing_encodes_a_shared_image_once(family_model):
    _, folder, model = family_model
    _, data = image_batch(folder)
    extra = image_inputs(
        model,
        data.batch["input_ids"],
        data.batch["attention_mask"],
        list(data.non_tensor_batch["image_inputs"]),
    )
    packed = pack_prefix_tree(data, extra=extra)
    # 5 images in the rows, 3 encoder inputs: the group's and the two-image prompt's red one share their
    # prefix through the image; the red one after other text and the blue one do not
    red, blue = extra.images[3]
    assert [im.key for im in packed.images] == [red.key, red.key, blue.key]
    assert int(data.batch["attention_mask"].sum()) > packed.input_ids.shape[1]


def test_gradients_of_image_rows_match_row_by_row(family_model, plain_log_probs):
    family, folder, model = family_model
    samples, data = image_batch(folder)
    weights = torch.linspace(0.5, 1.5, data.batch["responses"].shape[1])

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected = grads(sum((lp * weights[: len(lp)]).sum() for lp in plain_log_probs(model, data, grad=True)))
    for share in (True, False):
        log_probs, _ = response_log_probs(model, data, share_prompt=share)
        got = grads((log_probs * weights * data.batch["response_mask"]).sum())
        assert got.keys() == expected.keys()
        vision = [n for n in got if "visual" in n or "vision" in n]
        assert vision and any(got[n].abs().sum() > 0 for n in vision)  # the vision tower is trained too
        for name in expected:
            assert torch.allclose(got[name], expected[name], atol=1e-4), (family, share, name)
