"""Which of hybridflow's paths run a given model exactly, and what each does where it cannot.

Every fast path rewrites a plain row-by-row forward (prefix trees, padding-free rows, a cached decoding loop,
sequence parallelism, sharding, adapters), and each is exact only for the layers it was written for
(``hybridflow.models.layers``). ``support_line`` reads a model's line of that matrix from the model itself:
``exact`` (checked against the row-by-row forward on the tiny model of every family in
``hybridflow.models.families``), ``falls back`` (to a slower path that is exact; said in one warning line
where a key asked for it), ``refused`` (one error line naming the model type and the key), or ``unchecked``
(the engine is not installed here). ``hybridflow doctor`` prints it; ``tests/models/test_families.py`` checks
every cell on every family.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

from transformers import PreTrainedModel

from hybridflow.models.layers import LayerLayout, layer_layout
from hybridflow.workers.rollout.vllm_rollout import CPU_CHECKED, CPU_REFUSED
from hybridflow.workers.row_layouts import packs_as_tree
from hybridflow.workers.ulysses import takes_4d_mask, ulysses_problems

Verdict = Literal["exact", "falls back", "refused", "unchecked"]


@dataclass(frozen=True)
class Cell:
    """One path's verdict on one model, and why (empty when there is nothing to say)."""

    path: str
    verdict: Verdict
    note: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.verdict}" + (f" ({self.note})" if self.note else "")


def _packing(model: PreTrainedModel, layout: LayerLayout) -> Cell:
    path = "prefix-tree packing (share_prompt_prefix)"
    if packs_as_tree(model, layout):
        note = "each sliding layer under its own window" if "sliding_attention" in layout.types else ""
        return Cell(path, "exact", note)
    why = (
        f"{' and '.join(layout.recurrent)} layers" if layout.recurrent else "no 4-D masks in flash attention"
    )
    return Cell(path, "falls back", f"scored row by row: {why}")


def _padding_free(model: PreTrainedModel, layout: LayerLayout) -> Cell:
    path = "padding-free rows (use_remove_padding)"
    if layout.recurrent:
        return Cell(
            path, "falls back", f"scored padded: {' and '.join(layout.recurrent)} layers carry a state"
        )
    how = "block masks per layer type" if takes_4d_mask(model) else "positions from 0 per row"
    return Cell(path, "exact", how)


def _rollout(layout: LayerLayout) -> Cell:
    note = ""
    if layout.recurrent or "sliding_attention" in layout.types:
        note = "prompts of different lengths do not share a prefix run"
    return Cell("hf rollout (n > 1, early ends, left padding)", "exact", note)


def _ulysses(model: PreTrainedModel) -> Cell:
    problems = ulysses_problems(model, 1)
    path = "ulysses sequence parallelism"
    return (
        Cell(path, "refused", problems[0])
        if problems
        else Cell(path, "exact", "heads must divide by its size")
    )


def _experts(layout: LayerLayout) -> Cell:
    path = "router replay (R2, R3), load-balancing loss"
    if not layout.is_moe:
        return Cell(path, "falls back", "no routed experts: nothing to replay, one warning says so")
    return Cell(path, "exact", f"{layout.experts} experts, top {layout.top_k}")


def _vllm(model: PreTrainedModel) -> Cell:
    path = "vllm rollout"
    if importlib.util.find_spec("vllm") is None:
        return Cell(path, "unchecked", "vLLM is not installed here; make test-vllm checks its CPU build")
    import torch

    if torch.cuda.is_available():
        return Cell(path, "unchecked", "vLLM on a GPU: rollout/logprob_diff reports it every step")
    kind = layer_layout(model.config).model_type
    if kind in CPU_CHECKED:
        return Cell(path, "exact", "vLLM's CPU build")
    return Cell(path, "refused", CPU_REFUSED.get(kind, "not checked on vLLM's CPU build"))


def support_line(model: PreTrainedModel) -> list[Cell]:
    """``model``'s verdict on every path (its line of the matrix)."""
    layout = layer_layout(model.config)
    lora_note = "routed experts keep their weights (not nn.Linear)" if layout.is_moe else ""
    return [
        _rollout(layout),
        _packing(model, layout),
        _padding_free(model, layout),
        Cell("row-by-row scoring", "exact"),
        _ulysses(model),
        Cell("fsdp2 sharding", "exact"),
        Cell("lora adapters", "exact", lora_note),
        Cell("save and reload (Hugging Face folder)", "exact"),
        _experts(layout),
        _vllm(model),
    ]
