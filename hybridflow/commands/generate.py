"""``hybridflow generate --model PATH --prompt ... [--image FILE ...]``: what a checkpoint answers.

Text prompts go through the model's chat template and ``generate`` (``runs.trained_model.chat``). With
``--image`` (a vision-language checkpoint) every prompt gets the images, placed where its ``<image>`` markers
are (before the text when it has none), and the answer comes from the Hugging Face rollout engine training
uses, so the positions, image tokens and sampling are the ones the policy was trained with.
"""

from __future__ import annotations

import argparse

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.config.schema import RolloutConfig
from hybridflow.data.dataset import left_pad
from hybridflow.data.images import IMAGE_MARKER, ImagePrompts, decode_image
from hybridflow.models.vision import IMAGES
from hybridflow.protocol import DataProto
from hybridflow.runs.trained_model import actor_folder, chat, load_trained_actor
from hybridflow.utils.errors import InputError
from hybridflow.workers.rollout import HFRollout


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridflow generate", description="Answer prompts with a trained actor (or any HF model)."
    )
    parser.add_argument(
        "--model", required=True, help="run folder, global_step_N folder, model folder or 'default'"
    )
    parser.add_argument("--prompt", action="append", required=True, help="a user message (repeatable)")
    parser.add_argument(
        "--image", action="append", default=[], help="an image file every prompt shows (repeatable; a VLM)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    return parser


def answer_with_images(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    processor: ImagePrompts,
    prompt: str,
    image_files: list[str],
    max_new_tokens: int,
    temperature: float,
) -> str:
    """One user turn showing ``image_files`` (where ``prompt``'s ``<image>`` markers are, else first)."""
    images = tuple(processor.image_input(*decode_image(f, f"--image {f}")) for f in image_files)
    text = prompt if IMAGE_MARKER in prompt else IMAGE_MARKER * len(images) + prompt
    ids = processor.encode([{"role": "user", "content": text}], images, "--prompt")
    row = {k: v[None] for k, v in left_pad(ids, len(ids), tokenizer.pad_token_id).items()}
    prompts = DataProto.from_dict(row, {IMAGES: [images]})
    sampled = temperature > 0
    config = RolloutConfig(
        n=1, do_sample=sampled, temperature=temperature if sampled else 1.0, top_k=0, top_p=1.0
    )
    out = HFRollout(model, tokenizer, config, max_new_tokens, seed=0).generate_sequences(prompts)
    response = out.tensors["responses"][0][out.tensors["response_mask"][0].bool()]
    return str(tokenizer.decode(response, skip_special_tokens=True))  # one row of ids: one string


def main(argv: list[str]) -> int:
    """``hybridflow generate``: answer ``--prompt`` (with ``--image``s on a vision-language model) with a
    trained actor and print the answer."""
    args = _parser().parse_args(argv)
    model, tokenizer = load_trained_actor(args.model)
    processor = None
    if args.image:
        processor = ImagePrompts.from_pretrained(str(actor_folder(args.model)), tokenizer)
        if processor is None:
            raise InputError(f"--image: {args.model} is a text model; give a vision-language checkpoint")
    for prompt in args.prompt:
        if processor is None:
            reply = chat(model, tokenizer, prompt, args.max_new_tokens, args.temperature)
        else:
            reply = answer_with_images(
                model, tokenizer, processor, prompt, args.image, args.max_new_tokens, args.temperature
            )
        print(f">>> {prompt}\n{reply}")
    return 0
