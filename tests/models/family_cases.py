"""Tests' helpers for the model-family conformance matrix: each family's tiny model (weights drawn wider than
the init's, so that a window, a routing flip or a lost state changes the log-probs by far more than the
tolerance), a batch laid out as the rollout lays one out, and the plain row-by-row forward every path is held
against."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hybridflow import DataProto
from hybridflow.models.families import TINY_FAMILIES
from hybridflow.models.tiny import make_tiny_model

FAMILIES = list(TINY_FAMILIES)
LAYERS = 4  # every layer type of the families' patterns twice; DeepSeek and GLM: one dense layer, three MoE


def family_folder(root: Path, family: str) -> str:
    """A tiny ``family`` model with weights ~ N(0, 0.1) (norms and biases as initialised), saved to ``root``."""
    folder = make_tiny_model(root / family, family=family, num_layers=LAYERS)
    model = AutoModelForCausalLM.from_pretrained(folder)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() > 1 and "norm" not in name:
                weight.normal_(0, 0.1)
    model.save_pretrained(folder)
    return folder


def rows(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(prompt, response)`` pairs: three prompts (12-20 tokens, the first 6 the same in all, as a system
    prompt) with 3, 2 and 1 samples of 0-22 response tokens, so prompt and response together pass a 16-token
    window and rows share runs of tokens at two depths."""
    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(5, 900, (n,), generator=gen)  # noqa: E731
    head = ids(6)
    out = []
    for prompt_len, response_lens in ((14, (22, 9, 0)), (6, (17, 22)), (10, (13,))):
        prompt = torch.cat([head, ids(prompt_len)])
        out += [(prompt, ids(n)) for n in response_lens]
    return out


def laid_out(pairs: list[tuple[torch.Tensor, torch.Tensor]], prompt_width: int, length: int) -> DataProto:
    """``(prompt, response)`` pairs laid out as the rollout lays them out: left-padded prompts, right-padded
    responses, positions counting each row's real tokens."""
    ids = torch.zeros(len(pairs), prompt_width + length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (prompt, response) in enumerate(pairs):
        ids[r, prompt_width - len(prompt) : prompt_width + len(response)] = torch.cat([prompt, response])
        mask[r, prompt_width - len(prompt) : prompt_width + len(response)] = 1
    columns = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
    return DataProto.from_dict(
        {**columns, "responses": ids[:, prompt_width:], "response_mask": mask[:, prompt_width:]}
    )


def scoring_batch(seed: int = 0) -> DataProto:
    """``rows`` laid out (``laid_out``), with a ``weights`` column that turns log-probs into a loss whose
    gradient every token shapes."""
    data = laid_out(rows(seed), prompt_width=20, length=22)
    data.batch["weights"] = torch.linspace(-1, 1, len(data))[:, None] * torch.linspace(0.5, 1.5, 22)
    return data


def row_by_row(model, data: DataProto) -> torch.Tensor:
    """Each response token's log-prob from a plain forward of its row alone (no padding, no mask, no cache):
    what every path must reproduce, ``(bs, L)``, zero at padding."""
    length = data.batch["responses"].shape[1]
    out = torch.zeros(len(data), length)
    for r in range(len(data)):
        real = data.batch["attention_mask"][r].bool()
        ids = data.batch["input_ids"][r][real][None]
        prompt = int(real[:-length].sum())
        count = int(real[-length:].sum())
        if count == 0:
            continue
        log_probs = model(input_ids=ids, use_cache=False).logits[0].float().log_softmax(-1)
        targets = ids[0, prompt : prompt + count]
        out[r, :count] = log_probs[prompt - 1 : prompt + count - 1].gather(1, targets[:, None]).squeeze(1)
    return out


def gradients(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_gradients_close(got: dict, want: dict, what: str) -> None:
    """Each parameter's gradient within 1e-4 of the reference's norm (and every one the reference has)."""
    assert got.keys() == want.keys(), what
    for name, grad in want.items():
        assert (got[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-7, f"{what}: {name}"
