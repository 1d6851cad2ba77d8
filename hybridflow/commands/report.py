"""``hybridflow report RUN_DIR [RUN_B ...]``: a run's curves, time budget and samples in one HTML file.

An RL run is judged by a handful of curves (reward, held-out accuracy, KL to the reference, entropy,
response length) and by where its time goes. This module reads what the trainer's ``file`` logger wrote in
the run folder (``metrics.jsonl``, ``timeline.jsonl``, ``val_generations.jsonl``, the ``global_step_N``
checkpoints), draws PNG figures with matplotlib and writes ``RUN_DIR/report.html``: self-contained (the
PNGs are embedded as base64, no network needed to open it), with the plotted numbers embedded as JSON and
as tables, so the file is also the data. It works on a run in progress (a line being written when the
file was read is skipped) and overlays several runs (the first run's folder receives the report).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from hybridflow.runs.checkpoint import list_checkpoints

TIMELINE_STEPS = 3  # steps drawn in the Gantt chart: the last few
LINESTYLES = ("-", "--", ":", "-.")
# Stages in the order a step runs them: one color each, the same in the stacked chart and the timeline.
STAGE_ORDER = (
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "replay_priorities",
    "validate",
    "checkpoint",
)


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


# ------------------------------------------------------------------------------------------ the curves


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


def _png(fig: Figure, path: Path) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def draw_curves(spec: CurveFigure, data: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> bytes:
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.subplots()
    right = ax.twinx() if any(c.right for c in spec.curves) else None
    colors = {c.label: f"C{i}" for i, c in enumerate(spec.curves)}
    for r, (run, lines) in enumerate(data.items()):
        for i, (label, points) in enumerate(lines.items()):
            curve = next(c for c in spec.curves if label.startswith(c.label))
            target = right if curve.right and right is not None else ax
            steps, values = zip(*points)
            name = label if len(data) == 1 else f"{label} ({run})"
            target.plot(
                steps,
                values,
                LINESTYLES[r % len(LINESTYLES)],
                color=colors.get(label, f"C{i}"),
                marker="o" if len(points) < 30 else None,
                markersize=3,
                label=name,
            )
    ax.set(title=spec.title, xlabel="step", ylabel=spec.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        right.set_ylabel(spec.right_label)
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=8, loc="best")
    return _png(fig, path)


# ------------------------------------------------------------------------------------------ where time goes


def stage_times(run: Run) -> dict[str, list[tuple[int, float]]]:
    """``{stage: [(step, seconds), ...]}`` from the ``timing_s/*`` metrics, the total ``step`` left out."""
    return {
        key.removeprefix("timing_s/"): run.series(key)
        for key in run.keys(r"timing_s/.+")
        if key != "timing_s/step"
    }


def _stage_colors(stages: list[str]) -> dict[str, str]:
    """A color per stage, in ``STAGE_ORDER`` (stages it does not know come after)."""
    ordered = [s for s in STAGE_ORDER if s in stages] + sorted(s for s in stages if s not in STAGE_ORDER)
    return {stage: f"C{i % 10}" for i, stage in enumerate(ordered)}


def draw_stage_times(runs: list[Run], path: Path) -> bytes:
    """One stacked bar per step (seconds per stage), one panel per run."""
    fig = Figure(figsize=(7, 2.8 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    colors = _stage_colors([s for run in runs for s in stage_times(run)])
    for ax, run in zip(axes, runs):
        bottom: dict[int, float] = defaultdict(float)
        for stage, color in colors.items():
            points = stage_times(run).get(stage, [])
            if points:
                steps, seconds = zip(*points)
                ax.bar(steps, seconds, bottom=[bottom[s] for s in steps], color=color, label=stage)
                for s, v in points:
                    bottom[s] += v
        ax.set(title=f"Time per stage per step: {run.name}", xlabel="step", ylabel="seconds")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _png(fig, path)


def staleness_histogram(run: Run) -> dict[int, float]:
    """``{k: samples trained k weight versions after they were sampled}`` over the whole run (an asynchronous
    run's ``async/staleness_count/<k>``)."""
    keys = run.keys(r"async/staleness_count/\d+")
    return {int(key.rpartition("/")[2]): sum(v for _, v in run.series(key)) for key in keys}


def draw_staleness(hists: dict[str, dict[int, float]], path: Path) -> bytes:
    """Side-by-side bars per run: how many trained samples were how many weight versions old."""
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(hists)
    for i, (name, hist) in enumerate(hists.items()):
        ks = sorted(hist)
        ax.bar([k + i * width for k in ks], [hist[k] for k in ks], width=width, label=name)
    ax.set(
        title="Staleness of the trained samples (all steps)",
        xlabel="weight versions behind",
        ylabel="samples",
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(hists) > 1:
        ax.legend(fontsize=8)
    return _png(fig, path)


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


def draw_timeline(runs: list[Run], path: Path) -> bytes:
    """A Gantt chart per run: one lane per worker group, one bar per stage, the last few steps."""
    fig = Figure(figsize=(8, 2.4 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    colors = _stage_colors([s["stage"] for run in runs for s in timeline_spans(run)])
    for ax, run in zip(axes, runs):
        spans = timeline_spans(run)
        groups = list(dict.fromkeys(s["group"] for s in spans))
        for span in spans:
            lane = groups.index(span["group"])
            ax.barh(
                lane,
                span["end"] - span["start"],
                left=span["start"],
                height=0.6,
                color=colors[span["stage"]],
                edgecolor="black",
                linewidth=0.3,
            )
        for step in sorted({s["step"] for s in spans}):
            start = min(s["start"] for s in spans if s["step"] == step)
            ax.axvline(start, color="grey", linewidth=0.6, linestyle=":")
            ax.annotate(f"step {step}", (start, len(groups) - 0.4), fontsize=7, color="grey")
        ax.set_yticks(range(len(groups)), groups)
        ax.set_ylim(-0.6, len(groups) - 0.1)
        shown = len({s["step"] for s in spans})
        ax.set(title=f"Stage timeline, last {shown} step(s): {run.name}", xlabel="seconds")
        ax.legend(
            handles=[Patch(color=c, label=stage) for stage, c in colors.items()],
            fontsize=8,
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
        )
    return _png(fig, path)


# ------------------------------------------------------------------------------------------ samples


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
                "before_score": before.get("score"),
                "after": after.get("response"),
                "after_score": after.get("score"),
            }
        )
    return first, last, rows


# ------------------------------------------------------------------------------------------ HTML

_STYLE = """body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;
text-align:left;vertical-align:top}th{background:#f3f3f3}img{max-width:100%}details{margin-bottom:1.5em}
pre{white-space:pre-wrap;margin:0}"""


@dataclass(frozen=True)
class Prompt:
    """A sample's prompt in a table: its text, and thumbnails of its images (``data:`` URLs) beside it."""

    text: str | None
    images: tuple[str, ...] = ()


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Prompt):
        pictures = "".join(
            f"<img src='{html.escape(url)}' alt='image {i}' style='width:64px;margin-right:4px'>"
            for i, url in enumerate(value.images)
            if url.startswith("data:image/")
        )
        return pictures + _cell(value.text)
    return html.escape("" if value is None else str(value))


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _series_table(lines: dict[str, dict[str, list[tuple[int, float]]]]) -> str:
    """One column per (run, line), one row per step: the numbers a curve figure draws."""
    columns = [(run, label) for run, by_label in lines.items() for label in by_label]
    values = {
        (run, label): dict(points) for run, by_label in lines.items() for label, points in by_label.items()
    }
    steps = sorted({s for points in values.values() for s in points})
    header = ["step"] + [label if len(lines) == 1 else f"{label} ({run})" for run, label in columns]
    return _table(header, [[step] + [values[c].get(step) for c in columns] for step in steps])


def _section(title: str, png: bytes, numbers: str) -> str:
    image = base64.b64encode(png).decode("ascii")
    return (
        f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{image}'>"
        f"<details><summary>numbers</summary>{numbers}</details>"
    )


def _summary(run: Run) -> list[Any]:
    steps = sorted(s for s, row in run.metrics.items() if "timing_s/step" in row)
    step_times = [row["timing_s/step"] for s, row in run.metrics.items() if "timing_s/step" in row]
    last_acc = ", ".join(
        f"{k.split('/')[1]} {run.series(k)[-1][1]:.3g}"
        for k in run.keys(r"val/.+/acc/mean@\d+")
        if run.series(k)
    )
    median = sorted(step_times)[len(step_times) // 2] if step_times else None
    return [
        run.name,
        str(run.path),
        steps[-1] if steps else 0,
        "-" if median is None else median,
        last_acc or "-",
        ", ".join(map(str, run.checkpoints)) or "-",
    ]


def _finite(value: Any) -> Any:
    """NaN and infinities as null: JSON has no literal for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Read the runs, write the PNG figures into ``<out>/report/`` and ``<out>/report.html``; ``out``
    defaults to the first run's folder. Returns the HTML file's path."""
    runs = [load_run(d) for d in run_dirs]
    names = [run.name for run in runs]
    for run in runs:  # two runs called "demo" in different places: tell them apart by path
        if names.count(run.name) > 1:
            run.name = str(run.path)
    out_dir = Path(out) if out is not None else runs[0].path
    figures_dir = out_dir / "report"
    figures_dir.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "runs": [{"name": r.name, "path": str(r.path), "checkpoints": r.checkpoints} for r in runs],
        "figures": {},
    }
    sections, missing = [], []
    for spec in CURVE_FIGURES:
        lines = curve_data(runs, spec)
        if not any(lines.values()):
            missing.append(spec.title)
            continue
        data["figures"][spec.name] = lines
        png = draw_curves(spec, lines, figures_dir / f"{spec.name}.png")
        sections.append(_section(spec.title, png, _series_table(lines)))
    times = {run.name: stage_times(run) for run in runs}
    if any(times.values()):
        data["figures"]["stage_times"] = times
        png = draw_stage_times(runs, figures_dir / "stage_times.png")
        sections.append(_section("Time per stage per step (seconds)", png, _series_table(times)))
    hists = {run.name: staleness_histogram(run) for run in runs}
    if any(hists.values()):
        data["figures"]["staleness_histogram"] = hists
        png = draw_staleness({name: h for name, h in hists.items() if h}, figures_dir / "staleness.png")
        rows = [[name, k, count] for name, hist in hists.items() for k, count in sorted(hist.items())]
        sections.append(
            _section(
                "Staleness of the trained samples", png, _table(["run", "versions behind", "samples"], rows)
            )
        )
    spans = {run.name: timeline_spans(run) for run in runs}
    if any(spans.values()):
        data["figures"]["timeline"] = spans
        png = draw_timeline(runs, figures_dir / "timeline.png")
        rows = [
            [name, s["step"], s["group"], s["stage"], s["start"], s["end"]]
            for name, run_spans in spans.items()
            for s in run_spans
        ]
        sections.append(
            _section(
                "Stage timeline (which worker group ran what, when)",
                png,
                _table(["run", "step", "group", "stage", "start s", "end s"], rows),
            )
        )
    else:
        missing.append("stage timeline (timeline.jsonl)")
    for run in runs:
        pairs = generation_pairs(run)
        if pairs is None:
            continue
        first, last, rows = pairs
        data.setdefault("generations", {})[run.name] = {
            "before_step": first,
            "after_step": last,
            "rows": rows,
        }
        if first == last:  # one validation so far
            table = _table(
                ["prompt", f"step {first}", "score"],
                [[Prompt(r["prompt"], tuple(r["images"])), r["before"], r["before_score"]] for r in rows],
            )
            title = f"Validation samples at step {first} (none later yet)"
        else:
            table = _table(
                ["prompt", f"step {first}", "score", f"step {last}", "score"],
                [
                    [
                        Prompt(r["prompt"], tuple(r["images"])),
                        r["before"],
                        r["before_score"],
                        r["after"],
                        r["after_score"],
                    ]
                    for r in rows
                ],
            )
            title = "Validation samples before and after"
        sections.append(f"<h2>{title}: {html.escape(run.name)}</h2>{table}")
    summary = _table(
        ["run", "folder", "last step", "median s/step", "held-out acc (last)", "checkpoints"],
        [_summary(run) for run in runs],
    )
    note = f"<p>Not logged: {html.escape('; '.join(missing))}.</p>" if missing else ""
    payload = json.dumps(_finite(data)).replace("</", "<\\/")
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>hybridflow report: "
        f"{html.escape(', '.join(r.name for r in runs))}</title><style>{_STYLE}</style></head><body>"
        f"<h1>hybridflow run report</h1>{summary}{note}{''.join(sections)}"
        f"<script type='application/json' id='report-data'>{payload}</script></body></html>"
    )
    path = out_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    """``hybridflow report RUN_DIR [RUN_B ...] [--out DIR]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="hybridflow report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "runs", nargs="+", help="run folder(s) (trainer.default_local_dir); more than one overlays"
    )
    parser.add_argument("--out", help="folder for report.html and report/*.png (default: the first run's)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.runs, args.out)
    except FileNotFoundError as err:
        print(f"hybridflow report: error: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0
