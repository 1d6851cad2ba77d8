"""Per-step metrics computed on the driver from the batch, the timings and the workers' reports."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms import masked_mean
from hybridflow.protocol import DataProto


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Workers report lists (one entry per rank, mini-batch or micro-batch): log their mean."""
    return {k: float(np.mean(v)) if isinstance(v, list | tuple) else float(v) for k, v in metrics.items()}


#: The worker group each stage of a training step runs on ("driver": the trainer's own process), validation
#: and checkpointing after it included; the run report draws one timeline lane per group.
STAGE_GROUPS: dict[str, str] = {
    "gen": "actor_rollout",
    "old_log_prob": "actor_rollout",
    "update_actor": "actor_rollout",
    "replay_priorities": "actor_rollout",
    "ref": "ref",
    "values": "critic",
    "update_critic": "critic",
    "reward": "driver",
    "adv": "driver",
    "step": "driver",
    "validate": "actor_rollout",
    "checkpoint": "actor_rollout",
}


class StepTimings(dict):
    """Seconds per stage (``{"gen": 3.1, ...}``, what ``timer`` adds up) plus each stage's wall-clock span
    ``{"stage", "group", "start", "end"}`` (Unix seconds), so a report can draw which group ran what, when."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[dict[str, Any]] = []


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Adds the block's wall time to ``timings[name]`` (seconds); a ``StepTimings`` also keeps its span."""
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
                    "group": STAGE_GROUPS.get(name, "driver"),
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
    b = batch.batch
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
    """Tokens processed (prompt + response) per second per worker, and seconds per step."""
    total_tokens = int(batch.batch["attention_mask"].sum())
    step_time = timings["step"]
    return {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_time,
        "perf/throughput": total_tokens / step_time / max(n_workers, 1),
    }
