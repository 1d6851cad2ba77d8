"""What ``hybridflow report`` reads in a run folder, as per-step series: the metrics (``metrics.jsonl``, one
merged dict per step), the stage spans (``timeline.jsonl``), the validation samples (``val_generations.jsonl``)
and the complete checkpoints; and which metrics each curve figure draws (``CURVE_FIGURES``).

Reading only (no matplotlib): ``report.py`` draws and writes what this gathers. A line a live run is writing,
or one a killed run left half-written, is skipped.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.runs.checkpoint import list_checkpoints

TIMELINE_STEPS = 3  # steps drawn in the Gantt chart: the last few


@dataclass
class Run:
    """What one run folder holds: per-step metrics (one merged dict per step), stage spans, samples."""

    path: Path
    name: str
    metrics: dict[int, dict[str, float]]
    timeline: list[dict[str, Any]] = field(default_factory=list)
    generations: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)

    def series(self, key: str) -> list[tuple[int, float]]:
        """``(step, value)`` for every step that logged ``key`` with a finite value."""
        return [
            (step, row[key])
            for step, row in sorted(self.metrics.items())
            if isinstance(row.get(key), int | float) and math.isfinite(row[key])
        ]

    def keys(self, pattern: str) -> list[str]:
        """Logged metric names that fully match the regular expression ``pattern``, sorted."""
        return sorted({k for row in self.metrics.values() for k in row if re.fullmatch(pattern, k)})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``; a line that does not parse (the one a live run is writing, or one a
    killed run left half-written) is skipped. A missing file is an empty list."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def load_run(path: str | Path) -> Run:
    """Read a run folder (``trainer.default_local_dir``); FileNotFoundError names what is missing."""
    path = Path(path)
    metrics_file = path / "metrics.jsonl"
    if not metrics_file.exists():
        what = "folder" if path.is_dir() else "run folder"
        raise FileNotFoundError(
            f"no metrics.jsonl in {what} {path}: report reads the files the trainer's "
            "'file' logger writes (trainer.logger must include file)"
        )
    metrics: dict[int, dict[str, float]] = defaultdict(dict)
    for row in read_jsonl(metrics_file):  # validation and training of one step may come as separate lines
        metrics[row.pop("step")].update(row)
    return Run(
        path,
        path.resolve().name,
        dict(metrics),
        read_jsonl(path / "timeline.jsonl"),
        read_jsonl(path / "val_generations.jsonl"),
        [step for step, _ in list_checkpoints(path)],
    )


@dataclass
class Curve:
    """One line of a figure: ``label`` and the metric keys (regular expressions) it draws, first found wins
    per run; ``right`` puts it on a second y axis (a ratio next to token counts)."""

    label: str
    patterns: tuple[str, ...]
    right: bool = False


@dataclass
class CurveFigure:
    name: str
    title: str
    ylabel: str
    curves: tuple[Curve, ...]
    right_label: str = ""


CURVE_FIGURES: tuple[CurveFigure, ...] = (
    CurveFigure(
        "reward",
        "Reward (training batch) and held-out accuracy",
        "score / accuracy",
        (
            Curve("train reward", ("critic/score/mean",)),
            Curve("held-out acc", (r"val/.+/acc/mean@\d+",)),
            Curve("held-out reward", (r"val/.+/reward/mean@\d+",)),
        ),
    ),
    CurveFigure(
        "kl",
        "KL divergence",
        "KL",
        (
            Curve("KL to reference (loss)", ("actor/kl_loss",)),
            Curve("KL to reference (in reward)", ("actor/reward_kl_penalty",)),
            Curve("KL to old policy", ("actor/ppo_kl",)),
        ),
    ),
    CurveFigure("entropy", "Policy entropy", "nats / token", (Curve("entropy", ("actor/entropy",)),)),
    CurveFigure(
        "response_length",
        "Response length",
        "tokens",
        (
            Curve("mean", ("response_length/mean",)),
            Curve("max", ("response_length/max",)),
            Curve("clip ratio", ("response_length/clip_ratio",), right=True),
        ),
        right_label="share hitting max_response_length",
    ),
    CurveFigure(
        "grad_norm",
        "Gradient norm (before clipping)",
        "norm",
        (Curve("actor", ("actor/grad_norm",)), Curve("critic", ("critic/grad_norm",))),
    ),
    CurveFigure(
        "lr", "Learning rate", "lr", (Curve("actor", ("actor/lr",)), Curve("critic", ("critic/lr",)))
    ),
    CurveFigure(
        "async",
        "Asynchronous training: staleness of the trained samples, idle time",
        "weight versions behind",
        (
            Curve("staleness mean", ("async/staleness_mean",)),
            Curve("staleness max", ("async/staleness_max",)),
            Curve("rollout idle", ("async/rollout_idle_frac",), right=True),
            Curve("trainer idle", ("async/trainer_idle_frac",), right=True),
        ),
        right_label="share of the step's time",
    ),
)


def curve_data(runs: list[Run], spec: CurveFigure) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{run name: {line label: [(step, value), ...]}}``; a pattern matching several keys (one held-out
    accuracy per data source) gives one line per key."""
    data: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for run in runs:
        lines = {}
        for curve in spec.curves:
            for pattern in curve.patterns:
                keys = run.keys(pattern)
                for key in keys:
                    label = curve.label if len(keys) == 1 else f"{curve.label} {key.split('/')[1]}"
                    if run.series(key):
                        lines[label] = run.series(key)
                if keys:
                    break
        data[run.name] = lines
    return data


def stage_times(run: Run) -> dict[str, list[tuple[int, float]]]:
    """``{stage: [(step, seconds), ...]}`` from the ``timing_s/*`` metrics, the total ``step`` left out."""
    return {
        key.removeprefix("timing_s/"): run.series(key)
        for key in run.keys(r"timing_s/.+")
        if key != "timing_s/step"
    }


def staleness_histogram(run: Run) -> dict[int, float]:
    """``{k: samples trained k weight versions after they were sampled}`` over the whole run (an asynchronous
    run's ``async/staleness_count/<k>``)."""
    keys = run.keys(r"async/staleness_count/\d+")
    return {int(key.rpartition("/")[2]): sum(v for _, v in run.series(key)) for key in keys}


def timeline_spans(run: Run, last: int = TIMELINE_STEPS) -> list[dict[str, Any]]:
    """The stage spans of the ``last`` steps logged, times in seconds from the first one's start."""
    steps = sorted({span["step"] for span in run.timeline})[-last:]
    spans = [s for s in run.timeline if s["step"] in steps and s["stage"] != "step"]
    if not spans:
        return []
    origin = min(s["start"] for s in spans)
    return [
        {
            "step": s["step"],
            "stage": s["stage"],
            "group": s["group"],
            "start": round(s["start"] - origin, 4),
            "end": round(s["end"] - origin, 4),
        }
        for s in spans
    ]


def _score_cell(sample: dict[str, Any]) -> Any:
    """A sample's score, with the judge's raw verdict when a judge scored it."""
    if "verdict" not in sample:
        return sample.get("score")
    return f"{sample.get('score')} (judge: {sample['verdict']})"


def generation_pairs(run: Run) -> tuple[int, int, list[dict[str, Any]]] | None:
    """The validation samples of the first and the last validation that logged some, side by side by
    sample index: ``(first step, last step, [{"prompt", "before", "before_score", "after", ...}])``."""
    by_step: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for sample in run.generations:
        by_step[sample["step"]][sample.get("index", len(by_step[sample["step"]]))] = sample
    if not by_step:
        return None
    first, last = min(by_step), max(by_step)
    rows = []
    for index, before in sorted(by_step[first].items()):
        after = by_step[last].get(index, {})
        rows.append(
            {
                "prompt": before.get("prompt"),
                "images": before.get("images", []),
                "before": before.get("response"),
                "before_score": _score_cell(before),
                "after": after.get("response"),
                "after_score": _score_cell(after),
            }
        )
    return first, last, rows
