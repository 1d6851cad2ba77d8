"""What ``hybridflow doctor`` reports: a ``Check`` per line (verdict, what was found, the fix) and the
``Context`` that earlier checks fill for later ones. Its own module so that the checks can live in several."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from hybridflow.commands.memory_estimate import ModelShape
from hybridflow.config.schema import PPOConfig

Verdict = Literal["ok", "warn", "fail", "skip"]
LABELS = {"ok": "ok  ", "warn": "warn", "fail": "FAIL", "skip": "skip"}


@dataclass
class Check:
    """One line of the report: a verdict, what was found and, unless ok, what to do about it."""

    name: str
    verdict: Verdict
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """``ok    name        detail  -> fix: ...``: the check as the report prints it."""
        text = f"{LABELS[self.verdict]}  {self.name:<11} {self.detail}"
        return f"{text}  -> fix: {self.fix}" if self.fix else text


@dataclass
class Context:
    """What earlier checks found and later ones use."""

    cfg: PPOConfig | None = None
    tokenizer: Any = None
    processor: Any = None  # a vision-language model's image processing (ImagePrompts), None for a text model
    shape: ModelShape | None = None
    hf_config: Any = None  # the model's Hugging Face config (check_model loads it)
    rows: list[Any] = field(default_factory=list)  # parsed PromptRows of the training files' first rows
    train_rows: int | None = None  # training prompts left after filtering (None: files longer than read)
    prompt_tokens: int | None = None  # the longest prompt read, at most data.max_prompt_length (memory)

    @property
    def config(self) -> PPOConfig:
        """``cfg``, for the checks ``run_checks`` runs only once the config resolved."""
        if self.cfg is None:
            raise RuntimeError("this check needs a config that resolves (check_config first)")
        return self.cfg

    @property
    def model_shape(self) -> ModelShape:
        """``shape``, for the checks ``run_checks`` runs only once the model's config loaded."""
        if self.shape is None:
            raise RuntimeError("this check needs the model's config (check_model first)")
        return self.shape
