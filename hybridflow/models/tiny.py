"""Tiny random Llama models with a small trained tokenizer, for tests and smoke runs.

Why: the real vocabulary (49152 tokens) makes the output layer dominate every operation of a test
model; with about 1k tokens a train step of a 2-layer model takes tens of milliseconds. The tokenizer
is a byte-level BPE trained offline on a built-in corpus (English, arithmetic, the demo prompts), so
it encodes any text, round-trips it exactly and needs no download. Its chat template, special
tokens and eos/pad convention copy SmolLM2's, so code written against the tiny model runs unchanged
on the default model.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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


def training_corpus() -> list[str]:
    """The built-in text the tokenizer is trained on (deterministic, about 20 kB)."""
    rng = random.Random(0)
    return _ENGLISH.splitlines() + _arithmetic_lines(rng, 150) + _countdown_lines(rng, 60)


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
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
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    return tokenizer.to_str()


def make_tiny_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of at most `vocab_size` tokens with SmolLM2's special tokens.

    eos = pad = `<|im_end|>` (the end of an assistant turn), bos = `<|im_start|>`, unk =
    `<|endoftext|>`, as in SmolLM2-Instruct. The corpus bounds the number of merges, so the
    vocabulary may come out a little smaller than asked; `len(tokenizer)` is the true size.
    """
    if vocab_size < 300:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: 256 byte tokens and 3 special tokens come first"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
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
) -> str:
    """Write a randomly initialised small LlamaForCausalLM and its tokenizer to `out_dir`.

    The folder is a plain Hugging Face checkpoint (safetensors, tokenizer files, generation config
    with eos/pad set) that `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load without
    hybridflow. The model's vocabulary equals the tokenizer's, so sampling never yields an id the
    tokenizer cannot decode. `intermediate_size` defaults to 2 * hidden_size. Returns the folder.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    tokenizer = make_tiny_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    bos_id = tokenizer.convert_tokens_to_ids(IM_START)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        attention_dropout=attention_dropout,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)


def reply_mask(
    tokenizer: PreTrainedTokenizerFast, conversation: list[dict[str, str]]
) -> tuple[list[int], list[bool]]:
    """A conversation's token ids and which of them the model writes: the assistant turns after the last user
    message, each from its first token through the template's end of turn.

    Why: assistant turns before the last user message belong to the prompt (a one-shot example), and a rollout
    never writes them. Each turn's span is found by rendering the chat up to the turn's generation prompt and
    through the turn; a template that rewrites earlier turns breaks that and is refused."""

    def render(messages: list[dict[str, str]], prompt: bool = False) -> list[int]:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=True, return_dict=False
        )

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
    for step in itertools.count():
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


def main(argv: list[str] | None = None) -> int:
    """`hybridflow make-tiny-model OUT_DIR [...]`: write a tiny model folder and print its path."""
    parser = argparse.ArgumentParser(
        prog="hybridflow make-tiny-model",
        description="Write a small random Llama model and a ~1k-token BPE tokenizer (tests, smoke runs).",
    )
    parser.add_argument("out_dir", help="folder to write the model and tokenizer to")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = make_tiny_model(
        args.out_dir,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        seed=args.seed,
    )
    print(f"wrote tiny model to {path} in {time.perf_counter() - start:.1f} s")
    return 0
