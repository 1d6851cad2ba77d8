"""Tiny random Llama models with a small trained tokenizer, for tests and smoke runs.

Why: the real vocabulary (49152 tokens) makes the output layer dominate every operation of a test
model; with about 1k tokens a train step of a 2-layer model takes tens of milliseconds. The tokenizer
is a byte-level BPE trained offline on a built-in corpus (English, arithmetic, the demo prompts), so
it encodes any text, round-trips it exactly and needs no download. Its chat template, special
tokens and eos/pad convention copy SmolLM2's, so code written against the tiny model runs unchanged
on the default model.

Vision-language models (``make_tiny_vlm``, ``hybridflow make-tiny-model --vlm FAMILY``), because the real
checkpoints (Qwen2-VL-2B and up) take minutes per operation on a CPU and cannot be downloaded
here. A tiny model of the real architecture (the family's own ``*ForConditionalGeneration`` class, vision
tower and projector included, a 2-layer language model of width 64, a 2-block vision tower half as wide) runs each forward in milliseconds, so
every path (rollout, scoring, packing, update, checkpoint) is tested on the very code a real checkpoint runs.

Each folder holds the model, the tiny BPE tokenizer above with the family's image tokens added, a
ChatML chat template that writes the family's image placeholder for ``{"type": "image"}`` content parts,
and the image processor's config (``preprocessor_config.json``) with ``processor_config.json``, so
``AutoModelForImageTextToText`` loads the model and ``AutoProcessor`` the processor: for LLaVA here; for the
Qwen families ``AutoProcessor`` also builds a video processor, which needs torchvision, which does not load
beside the local torch build, so hybridflow reads the image processor alone (``hybridflow.data.images.ImagePrompts``).
The image processors run on their PIL backend (transformers falls back to it without torchvision).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from hybridflow.models.families import TINY_FAMILIES, tiny_config

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]

# ChatML, as SmolLM2 uses it (without SmolLM2's built-in system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A small model can learn to add two numbers when it is
rewarded for the right answer. Reinforcement learning from human feedback trains a policy with a
reward model, a critic and a reference model. The policy writes a response to each prompt; the reward
tells it how good the response was, and the advantage says which tokens to make more likely.
You are a helpful assistant. Please answer the question and show your work step by step. Let's think
about this problem carefully. What is the answer? The answer is the number after the equals sign.
Each number must be used exactly once. Write the final equation inside the answer tags.
There are many ways to solve a problem, but only one correct result. If you are not sure, check your
work again. She had five apples and gave two of them to her friend, so she has three apples left.
He walked to the store, bought some bread and milk, and came back home before the rain started.
The teacher asked the students to compute the sum, the difference, the product and the quotient.
Numbers such as one, two, three, four, five, six, seven, eight, nine and ten are easy to read.
In the morning we read a book; in the evening we wrote a letter to our family and friends.
Training a language model takes time, data and patience. Good data makes a good model.
This is a simple test sentence, and here is another one with different words in it.
How many hours are in a day? There are twenty four hours in a day and seven days in a week.
If a train travels sixty miles in one hour, how far does it travel in three hours?
The store sells pencils for two dollars each. How much do four pencils cost in total?
I think that the result is correct, because the numbers add up to the total.
Please reply in the form shown in the example, and do not add anything else.
"""


def _arithmetic_lines(rng: random.Random, count: int) -> list[str]:
    """Lines in the demo task's form, so digits, '+', '=' and the prompt words get merged tokens."""
    lines = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        lines.append(f"Compute {a}+{b}. Reply in the form {a}+{b}=<answer>.\n{a}+{b}={a + b}")
        c, d = rng.randint(1, 99), rng.randint(1, 99)
        lines.append(f"{c} - {d} = {c - d}, {c} * {d} = {c * d}, ({c} + {d}) / 2 = {(c + d) / 2}")
    return lines


def _countdown_lines(rng: random.Random, count: int) -> list[str]:
    """Lines like the countdown task's prompts and answers."""
    lines = []
    for _ in range(count):
        x, y, z = (rng.randint(1, 99) for _ in range(3))
        lines.append(
            f"Using the numbers [{x}, {y}, {z}], create an equation that equals {x + y * z}. "
            f"<answer>{x} + {y} * {z}</answer>"
        )
    return lines


# the visual task's words (``prepare-data shapes``), which the vision-language tokenizer also learns, so that a
# one-word answer is one token: "blue" is 4 byte-pieces to the text tokenizer
_VISION_LINES = [
    "What colour is the shape? Reply with one word: red, green or blue. red green blue",
    "How many shapes are in the picture? Reply with a number from 1 to 4. 1 2 3 4",
    "Are there more red or more blue shapes? Reply with one word: red or blue. red blue",
    "Which colour is it? The picture shows a square. Look at the image and answer.",
    *["red", "green", "blue"],  # replies, which start a line: no leading space
]


def training_corpus(vision: bool = False) -> list[str]:
    """The built-in text the tokenizer is trained on (deterministic, about 20 kB); ``vision``: with the
    visual task's words."""
    rng = random.Random(0)
    lines = _ENGLISH.splitlines() + _arithmetic_lines(rng, 150) + _countdown_lines(rng, 60)
    return lines + _VISION_LINES * 100 if vision else lines


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int, vision: bool = False) -> str:
    """Train the byte-level BPE once per process and vocabulary size (training takes seconds)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(vision), trainer=trainer)
    return tokenizer.to_str()


def make_tiny_tokenizer(vocab_size: int = 1024, vision: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of at most `vocab_size` tokens with SmolLM2's special tokens.

    eos = pad = `<|im_end|>` (the end of an assistant turn), bos = `<|im_start|>`, unk =
    `<|endoftext|>`, as in SmolLM2-Instruct. The corpus bounds the number of merges, so the
    vocabulary may come out a little smaller than asked; `len(tokenizer)` is the true size. `vision`: trained
    on the visual task's words too (the tiny vision-language models' tokenizer).
    """
    if vocab_size < 300:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: 256 byte tokens and 3 special tokens come first"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size, vision)),
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=IM_END,
        unk_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


def make_tiny_model(
    out_dir: str | Path,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    attention_dropout: float = 0.0,
    family: str = "llama",
) -> str:
    """Write a randomly initialised small causal LM (LlamaForCausalLM unless ``family`` names another of
    ``hybridflow.models.families.TINY_FAMILIES``) and its tokenizer to `out_dir`.

    The folder is a plain Hugging Face checkpoint (safetensors, tokenizer files, generation config
    with eos/pad set) that `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load without
    hybridflow. The model's vocabulary equals the tokenizer's, so sampling never yields an id the
    tokenizer cannot decode. `intermediate_size` defaults to 2 * hidden_size. Returns the folder.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    tokenizer = make_tiny_tokenizer(vocab_size)
    eos_id = token_id(tokenizer, IM_END)
    bos_id = token_id(tokenizer, IM_START)
    shape = {
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_attention_heads": num_heads,
        "max_position_embeddings": max_position_embeddings,
        "attention_dropout": attention_dropout,
    }
    if family == "llama" or "num_key_value_heads" not in TINY_FAMILIES[family].settings:
        shape |= {"num_key_value_heads": num_kv_heads, "head_dim": hidden_size // num_heads}
    special = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    config = tiny_config(family, len(tokenizer), num_layers, special, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)


def reply_mask(
    tokenizer: PreTrainedTokenizerBase, conversation: list[dict[str, str]]
) -> tuple[list[int], list[bool]]:
    """A conversation's token ids and which of them the model writes: the assistant turns after the last user
    message, each from its first token through the template's end of turn.

    Why: assistant turns before the last user message belong to the prompt (a one-shot example), and a rollout
    never writes them. Each turn's span is found by rendering the chat up to the turn's generation prompt and
    through the turn; a template that rewrites earlier turns breaks that and is refused."""

    def render(messages: list[dict[str, str]], prompt: bool = False) -> list[int]:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=True, return_dict=False
        )
        if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):  # tokenize=True: the ids
            raise TypeError(f"apply_chat_template returned {ids!r:.80}, not token ids")
        return cast(list[int], ids)  # checked above

    ids = render(conversation)
    mask = [False] * len(ids)
    last_user = max((i for i, m in enumerate(conversation) if m["role"] == "user"), default=-1)
    for i in range(last_user + 1, len(conversation)):
        if conversation[i]["role"] != "assistant":
            continue
        before, through = render(conversation[:i], prompt=True), render(conversation[: i + 1])
        if ids[: len(before)] != before or ids[: len(through)] != through:
            raise ValueError(f"the chat template rewrites earlier turns of {conversation!r}: no reply span")
        mask[len(before) : len(through)] = [True] * (len(through) - len(before))
    if not any(mask):
        raise ValueError(f"no assistant reply after the last user message to teach in {conversation!r}")
    return ids, mask


def teach_conversations(
    model_dir: str | Path,
    conversations: list[list[dict[str, str]]],
    min_prob: float = 0.99,
    max_steps: int = 1000,
    lr: float = 5e-3,
    seed: int = 0,
) -> str:
    """Train the tiny model in ``model_dir`` (in place) until it writes the replies of ``conversations``
    with every reply token at probability ``min_prob`` or more; returns the folder.

    Why: a random model never writes a tool call, so multi-turn tests and examples would only ever see one
    turn. Supervised steps on the replies (``reply_mask``) give a real model whose real generations exercise
    tools. Teaching stops on that margin, not after a step count: how many steps it takes depends on the
    CPU's float kernels and thread count, and a model taught to the margin writes the replies greedily and,
    at temperature 0.5, samples each token with probability above 0.9999. The check uses the very forward
    pass whose gradient makes the next step (dropout off), so the saved model is the one checked. Raises
    ``ValueError`` naming the least likely reply token if ``max_steps`` updates do not reach the margin."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = [reply_mask(tokenizer, c) for c in conversations]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    replies = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, (ids, mask) in enumerate(rows):
        input_ids[r, : len(ids)], attention_mask[r, : len(ids)] = torch.tensor(ids), 1
        replies[r, : len(ids)] = torch.tensor(mask)
    targets, replies = input_ids[:, 1:], replies[:, 1:]  # position t predicts token t + 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    step = 0
    while True:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        log_probs = logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        least = log_probs.masked_fill(~replies, 0.0).flatten().argmin()
        if log_probs.flatten()[least].exp() >= min_prob:
            model.save_pretrained(model_dir, safe_serialization=True)
            return str(model_dir)
        if step == max_steps:
            row, pos = divmod(int(least), targets.shape[1])
            raise ValueError(
                f"after {max_steps} steps at lr {lr} the tiny model writes {tokenizer.decode(targets[row, pos])!r}"
                f" after {tokenizer.decode(input_ids[row, max(0, pos - 7) : pos + 1])!r} (conversation {row})"
                f" with probability {log_probs.flatten()[least].exp():.3f} < min_prob {min_prob}: raise"
                " max_steps, or check that no two conversations answer the same prompt differently"
            )
        (-log_probs[replies].mean()).backward()
        # clipped: without it, the old lr 1e-2 spiked the loss every ~150 steps and never learned to copy numbers
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step += 1


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of one ``token`` (``convert_tokens_to_ids`` types a list's result too)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise TypeError(f"convert_tokens_to_ids({token!r}) returned {found!r}")
    return found


# ------------------------------------------------------------------------------------ vision-language models
QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def vision_chat_template(placeholder: str) -> str:
    """ChatML (as the tiny text model's) where a message's content may be a list of parts: ``text`` parts
    are written as they are, each ``image`` part as ``placeholder`` (what the family's processor expands)."""
    return (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '" + placeholder + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{{ '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


def _text_config(tokenizer: PreTrainedTokenizerFast, hidden: int, layers: int, **extra: Any) -> dict:
    eos = token_id(tokenizer, IM_END)
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=token_id(tokenizer, IM_START),
        eos_token_id=eos,
        pad_token_id=eos,
        **extra,
    )


def _mrope(hidden: int) -> dict:
    """Qwen's rotary settings for a head of ``hidden / 4``: the (t, h, w) sections split its half-dimension."""
    half = hidden // 4 // 2
    return {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [half - 2 * (half // 3)] + [half // 3] * 2,
    }


def _qwen_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:  # config keywords
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return {name: token_id(tokenizer, token) for name, token in zip(names, QWEN_VISION_TOKENS)}


def _qwen2_vl(tokenizer: PreTrainedTokenizerFast, hidden: int, layers: int) -> tuple[PreTrainedModel, Any]:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2VLConfig(
        text_config=_text_config(tokenizer, hidden, layers, rope_parameters=_mrope(hidden)),
        vision_config=dict(depth=2, embed_dim=hidden // 2, hidden_size=hidden, num_heads=2, mlp_ratio=2),
        tie_word_embeddings=True,
        **_qwen_ids(tokenizer),
    )
    return Qwen2VLForConditionalGeneration(config), Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=112 * 112
    )


def _qwen2_5_vl(tokenizer: PreTrainedTokenizerFast, hidden: int, layers: int) -> tuple[PreTrainedModel, Any]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = dict(
        depth=2,
        hidden_size=hidden // 2,
        intermediate_size=hidden,
        num_heads=2,
        out_hidden_size=hidden,
        window_size=56,
        fullatt_block_indexes=[1],
    )
    config = Qwen2_5_VLConfig(
        text_config=_text_config(tokenizer, hidden, layers, rope_parameters=_mrope(hidden)),
        vision_config=vision,
        tie_word_embeddings=True,
        **_qwen_ids(tokenizer),
    )
    return Qwen2_5_VLForConditionalGeneration(config), Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=112 * 112
    )


def _qwen3_vl(tokenizer: PreTrainedTokenizerFast, hidden: int, layers: int) -> tuple[PreTrainedModel, Any]:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rope = {**_mrope(hidden), "mrope_interleaved": True}
    vision = dict(
        depth=2,
        hidden_size=hidden // 2,
        intermediate_size=hidden,
        num_heads=2,
        out_hidden_size=hidden,
        patch_size=16,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    config = Qwen3VLConfig(
        text_config=_text_config(tokenizer, hidden, layers, rope_parameters=rope, head_dim=hidden // 4),
        vision_config=vision,
        tie_word_embeddings=True,
        **_qwen_ids(tokenizer),
    )
    processor = Qwen2VLImageProcessorPil(patch_size=16, min_pixels=32 * 32, max_pixels=128 * 128)
    return Qwen3VLForConditionalGeneration(config), processor


def _llava(tokenizer: PreTrainedTokenizerFast, hidden: int, layers: int) -> tuple[PreTrainedModel, Any]:
    from transformers import LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    vision = dict(
        model_type="clip_vision_model",
        hidden_size=hidden // 2,
        intermediate_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=dict(model_type="llama", **_text_config(tokenizer, hidden, layers)),
        image_token_index=token_id(tokenizer, "<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return LlavaForConditionalGeneration(config), processor


_LLAVA_PROCESSOR = {
    "processor_class": "LlavaProcessor",
    "patch_size": 8,
    "vision_feature_select_strategy": "default",
    "num_additional_image_tokens": 1,
}

# family -> (builder, image tokens the tokenizer needs, what the chat template writes per image, the processor's
# processor_config.json or its class)
TINY_VLMS: dict[str, tuple[Callable[..., tuple[PreTrainedModel, Any]], list[str], str, str | dict]] = {
    "qwen2_vl": (
        _qwen2_vl,
        QWEN_VISION_TOKENS,
        "<|vision_start|><|image_pad|><|vision_end|>",
        "Qwen2VLProcessor",
    ),
    "qwen2_5_vl": (
        _qwen2_5_vl,
        QWEN_VISION_TOKENS,
        "<|vision_start|><|image_pad|><|vision_end|>",
        "Qwen2_5_VLProcessor",
    ),
    "qwen3_vl": (
        _qwen3_vl,
        QWEN_VISION_TOKENS,
        "<|vision_start|><|image_pad|><|vision_end|>",
        "Qwen3VLProcessor",
    ),
    "llava": (_llava, ["<image>"], "<image>", _LLAVA_PROCESSOR),
}


def make_tiny_vlm(
    out_dir: str | Path, family: str = "qwen2_vl", hidden_size: int = 64, num_layers: int = 2, seed: int = 0
) -> str:
    """Write a randomly initialised tiny vision-language model of ``family`` (``TINY_VLMS``), its tokenizer
    (with the image tokens), chat template and image processor to ``out_dir``; returns the folder."""
    if family not in TINY_VLMS:
        raise ValueError(f"unknown tiny VLM family {family!r}; known: {', '.join(TINY_VLMS)}")
    build, image_tokens, placeholder, processor_class = TINY_VLMS[family]
    tokenizer = make_tiny_tokenizer(vision=True)
    tokenizer.add_special_tokens({"additional_special_tokens": image_tokens})
    tokenizer.chat_template = vision_chat_template(placeholder)
    torch.manual_seed(seed)
    model, image_processor = build(tokenizer, hidden_size, num_layers)
    eos = token_id(tokenizer, IM_END)
    model.generation_config = GenerationConfig(
        bos_token_id=token_id(tokenizer, IM_START), eos_token_id=eos, pad_token_id=eos
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    _name_processor(out, processor_class, tokenizer.chat_template)
    return str(out)


def _name_processor(folder: Path, processor: str | dict, chat_template: str) -> None:
    """``processor_config.json`` and the template as ``chat_template.jinja``, laid out as a saved processor is;
    ``preprocessor_config.json`` names the default image processor class (the PIL one is a fallback)."""
    processor = {"processor_class": processor} if isinstance(processor, str) else processor
    processor_class = processor["processor_class"]
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2))
    (folder / "chat_template.jinja").write_text(chat_template)
    config_path = folder / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    config["image_processor_type"] = config["image_processor_type"].removesuffix("Pil")
    config["processor_class"] = processor_class
    config_path.write_text(json.dumps(config, indent=2))


def main(argv: list[str] | None = None) -> int:
    """`hybridflow make-tiny-model OUT_DIR [...]`: write a tiny model folder and print its path."""
    parser = argparse.ArgumentParser(
        prog="hybridflow make-tiny-model",
        description="Write a small random Llama model (or with --vlm a vision-language one) and a ~1k-token BPE "
        "tokenizer (tests, smoke runs).",
    )
    parser.add_argument("out_dir", help="folder to write the model and tokenizer to")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--family",
        choices=list(TINY_FAMILIES),
        default="llama",
        help="the text model family (default: llama); gemma3_text, gpt_oss and mistral get a 16-token window",
    )
    parser.add_argument(
        "--vlm",
        choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"],
        help="a tiny vision-language model of this family instead (vision tower, image tokens, image processor)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.vlm:
        path = make_tiny_vlm(args.out_dir, args.vlm, args.hidden_size, args.num_layers, args.seed)
    else:
        path = make_tiny_model(
            args.out_dir,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            seed=args.seed,
            family=args.family,
        )
    print(f"wrote tiny {args.vlm or args.family} model to {path} in {time.perf_counter() - start:.1f} s")
    return 0
