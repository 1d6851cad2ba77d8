"""Per-step metrics computed on the driver from the batch, the timings and the workers' reports, and the
validation metrics.

Validation: per data source, the mean reward over ``n`` samples and pass@n.

Every other numeric key a scorer reports (e.g. the calculator task's ``tool_call_ok``) is averaged too, as
``val/<source>/<key>/mean@n``. A sample counts as correct when its scorer reports ``acc`` for it, else when its score is positive (one
batch may mix sources whose scorers do and do not report ``acc``: those samples have None there).
pass@n is the fraction of prompts (grouped by ``uid``) with at least one correct sample among their ``n``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms import masked_mean
from hybridflow.protocol import DataProto
from hybridflow.runs.stages import STAGE_GROUPS, STAGE_ORDER


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Workers report lists (one entry per rank, mini-batch or micro-batch): log their mean."""
    return {k: float(np.mean(v)) if isinstance(v, list | tuple) else float(v) for k, v in metrics.items()}


class StepTimings(dict):
    """Seconds per stage (``{"gen": 3.1, ...}``, what ``timer`` adds up) plus each stage's wall-clock span
    ``{"stage", "group", "start", "end"}`` (Unix seconds), so a report can draw which group ran what, when."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[dict[str, Any]] = []


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Adds the block's wall time to ``timings[name]`` (seconds); a ``StepTimings`` also keeps its span, in
    the lane of the worker group that runs the stage. ``name`` is one of ``runs.stages.STAGES``."""
    if name not in STAGE_GROUPS:
        raise ValueError(
            f"unknown stage {name!r}: add it to hybridflow.runs.stages.STAGES (known: {STAGE_ORDER})"
        )
    start, wall = time.perf_counter(), time.time()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        timings[name] = timings.get(name, 0.0) + elapsed
        if isinstance(timings, StepTimings):
            timings.spans.append(
                {
                    "stage": name,
                    "group": STAGE_GROUPS[name],
                    "start": wall,
                    "end": wall + elapsed,
                }
            )


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def compute_data_metrics(batch: DataProto, use_critic: bool) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one training batch."""
    b = batch.tensors
    mask = b["response_mask"].float()
    response_length = mask.sum(-1)
    max_response = mask.shape[-1]
    metrics = {
        **_stats("critic/score", b["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", b["token_level_rewards"].sum(-1)),
        "critic/advantages/mean": masked_mean(b["advantages"], mask).item(),
        "critic/advantages/max": b["advantages"][mask.bool()].max().item(),
        "critic/advantages/min": b["advantages"][mask.bool()].min().item(),
        "critic/returns/mean": masked_mean(b["returns"], mask).item(),
        **_stats("response_length", response_length),
        "response_length/clip_ratio": (response_length == max_response).float().mean().item(),
        "prompt_length/mean": (b["attention_mask"].sum(-1) - response_length).float().mean().item(),
    }
    if use_critic:
        metrics["critic/values/mean"] = masked_mean(b["values"], mask).item()
    for key, column in batch.non_tensor_batch.items():
        if key.startswith("reward_extra/"):
            values = np.asarray([v for v in column if v is not None], dtype=float)
            if len(values):
                metrics[f"{key}/mean"] = float(values.mean())
    return metrics


def compute_throughput_metrics(
    batch: DataProto, timings: dict[str, float], n_workers: int
) -> dict[str, float]:
    """Tokens processed (prompt + response) per second per worker, seconds per step, and the share of the
    step spent scoring (``perf/reward_share``: a sandbox or a judge can dominate a step)."""
    total_tokens = int(batch.tensors["attention_mask"].sum())
    step_time = timings["step"]
    return {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_time,
        "perf/throughput": total_tokens / step_time / max(n_workers, 1),
        "perf/reward_share": timings.get("reward", 0.0) / step_time,
    }


def validation_metrics(rows: list[tuple[DataProto, dict[str, Any]]], n: int) -> dict[str, float]:
    """``rows``: ``(generated batch, reward result)`` pairs; the batch carries ``uid`` and ``data_source``,
    the result ``reward_tensor`` ``(bs, response_length)`` and optionally ``reward_extra_info["acc"]``."""
    scores: dict[str, list[float]] = defaultdict(list)
    accs: dict[str, list[float]] = defaultdict(list)
    extras: dict[tuple[str, str], list[float]] = defaultdict(list)
    correct_by_prompt: dict[tuple[str, str], bool] = {}
    for batch, result in rows:
        seq_scores = result["reward_tensor"].sum(-1).tolist()
        acc = result.get("reward_extra_info", {}).get("acc")
        acc = [None] * len(seq_scores) if acc is None else list(acc)
        other = {k: v for k, v in result.get("reward_extra_info", {}).items() if k not in ("acc", "score")}
        for i, score in enumerate(seq_scores):
            source = str(batch.non_tensor_batch["data_source"][i])
            scores[source].append(score)
            for key, values in other.items():
                if isinstance(values[i], int | float) and not isinstance(values[i], bool):
                    extras[(source, key)].append(float(values[i]))
            if acc[i] is not None:
                accs[source].append(float(acc[i]))
            correct = bool(acc[i]) if acc[i] is not None else score > 0
            key = (source, str(batch.non_tensor_batch["uid"][i]))
            correct_by_prompt[key] = correct_by_prompt.get(key, False) or correct
    metrics = {}
    for source, values in scores.items():
        metrics[f"val/{source}/reward/mean@{n}"] = float(np.mean(values))
        if accs[source]:
            metrics[f"val/{source}/acc/mean@{n}"] = float(np.mean(accs[source]))
        prompts = [ok for (s, _), ok in correct_by_prompt.items() if s == source]
        metrics[f"val/{source}/pass@{n}"] = float(np.mean(prompts))
    for (source, key), values in extras.items():
        metrics[f"val/{source}/{key}/mean@{n}"] = float(np.mean(values))
    return metrics
