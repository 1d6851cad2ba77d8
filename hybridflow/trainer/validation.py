"""Validation metrics: per data source, the mean reward over ``n`` samples and pass@n.

Every other numeric key a scorer reports (e.g. the calculator task's ``tool_call_ok``) is averaged too, as
``val/<source>/<key>/mean@n``. A sample counts as correct when its scorer reports ``acc`` for it, else when its score is positive (one
batch may mix sources whose scorers do and do not report ``acc``: those samples have None there).
pass@n is the fraction of prompts (grouped by ``uid``) with at least one correct sample among their ``n``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from hybridflow.protocol import DataProto


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
