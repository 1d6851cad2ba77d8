"""``hybridflow report RUN_DIR [RUN_B ...]``: a run's curves, time budget and samples in one HTML file.

An RL run is judged by a handful of curves (reward, held-out accuracy, KL to the reference, entropy,
response length) and by where its time goes. ``report_data`` reads what the trainer's ``file`` logger wrote in
the run folder (``metrics.jsonl``, ``timeline.jsonl``, ``val_generations.jsonl``, the ``global_step_N``
checkpoints); this module draws one PNG per figure of its table (``REPORT_FIGURES``) with matplotlib, in the
stages' one order and colours (``runs.stages``), and writes ``RUN_DIR/report.html``: self-contained (the
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
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from hybridflow.commands.report_data import (
    CURVE_FIGURES,
    CurveFigure,
    Run,
    curve_data,
    generation_pairs,
    load_run,
    stage_times,
    staleness_histogram,
    timeline_spans,
)
from hybridflow.runs.stages import STAGE_ORDER

LINESTYLES = ("-", "--", ":", "-.")


# ------------------------------------------------------------------------------------------ the curves


def _png(fig: Figure, path: Path) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def draw_curves(spec: CurveFigure, data: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> bytes:
    """One curve figure (``spec``) of ``curve_data``'s lines, one line style per run, written to ``path``."""
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


class ReportFigure(NamedTuple):
    """One figure of the report: what it plots of each run (``{run name: data}``; a run without any gives
    nothing), how it is drawn to a PNG and which table holds its numbers; ``missing``, when set, is said under
    "Not logged" for runs that logged none of it."""

    name: str  # its key in the embedded JSON, and its PNG's name unless ``png`` says otherwise
    title: str
    collect: Callable[[list[Run]], dict[str, Any]]
    draw: Callable[[list[Run], dict[str, Any], Path], bytes]
    numbers: Callable[[dict[str, Any]], str]
    missing: str | None = None
    png: str = ""


def _curve_figure(spec: CurveFigure) -> ReportFigure:
    return ReportFigure(
        spec.name,
        spec.title,
        lambda runs: curve_data(runs, spec),
        lambda runs, lines, path: draw_curves(spec, lines, path),
        _series_table,
        missing=spec.title,
    )


def _per_run(series: Callable[[Run], Any]) -> Callable[[list[Run]], dict[str, Any]]:
    """A figure's ``collect`` that takes ``series`` of each run alone: ``{run name: series(run)}``."""
    return lambda runs: {run.name: series(run) for run in runs}


def _staleness_table(hists: dict[str, dict[int, float]]) -> str:
    rows = [[name, k, count] for name, hist in hists.items() for k, count in sorted(hist.items())]
    return _table(["run", "versions behind", "samples"], rows)


def _timeline_table(spans: dict[str, list[dict[str, Any]]]) -> str:
    rows = [
        [name, s["step"], s["group"], s["stage"], s["start"], s["end"]]
        for name, run in spans.items()
        for s in run
    ]
    return _table(["run", "step", "group", "stage", "start s", "end s"], rows)


#: The report's figures, in the page's order: the curves, then where the time went.
REPORT_FIGURES: tuple[ReportFigure, ...] = (
    *(_curve_figure(spec) for spec in CURVE_FIGURES),
    ReportFigure(
        "stage_times",
        "Time per stage per step (seconds)",
        _per_run(stage_times),
        lambda runs, times, path: draw_stage_times(runs, path),
        _series_table,
    ),
    ReportFigure(
        "staleness_histogram",
        "Staleness of the trained samples",
        _per_run(staleness_histogram),
        lambda runs, hists, path: draw_staleness({name: h for name, h in hists.items() if h}, path),
        _staleness_table,
        png="staleness",
    ),
    ReportFigure(
        "timeline",
        "Stage timeline (which worker group ran what, when)",
        _per_run(timeline_spans),
        lambda runs, spans, path: draw_timeline(runs, path),
        _timeline_table,
        missing="stage timeline (timeline.jsonl)",
    ),
)


def _generation_sections(runs: list[Run], data: dict[str, Any]) -> list[str]:
    """Each run's validation samples, before and after (``data["generations"]`` gets them too)."""
    sections = []
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
        header, title = (
            ["prompt", f"step {first}", "score"],
            f"Validation samples at step {first} (none later yet)",
        )
        cells = [[Prompt(r["prompt"], tuple(r["images"])), r["before"], r["before_score"]] for r in rows]
        if first != last:
            header, title = [*header, f"step {last}", "score"], "Validation samples before and after"
            cells = [[*c, r["after"], r["after_score"]] for c, r in zip(cells, rows)]
        sections.append(f"<h2>{title}: {html.escape(run.name)}</h2>{_table(header, cells)}")
    return sections


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
    for figure in REPORT_FIGURES:
        collected = figure.collect(runs)
        if not any(collected.values()):
            missing += [figure.missing] if figure.missing else []
            continue
        data["figures"][figure.name] = collected
        png = figure.draw(runs, collected, figures_dir / f"{figure.png or figure.name}.png")
        sections.append(_section(figure.title, png, figure.numbers(collected)))
    sections += _generation_sections(runs, data)
    path = out_dir / "report.html"
    path.write_text(_page(runs, data, sections, missing), encoding="utf-8")
    return path


def _page(runs: list[Run], data: dict[str, Any], sections: list[str], missing: list[str]) -> str:
    """The self-contained HTML page: the summary table, the sections, the plotted numbers as JSON."""
    summary = _table(
        ["run", "folder", "last step", "median s/step", "held-out acc (last)", "checkpoints"],
        [_summary(run) for run in runs],
    )
    note = f"<p>Not logged: {html.escape('; '.join(missing))}.</p>" if missing else ""
    payload = json.dumps(_finite(data)).replace("</", "<\\/")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>hybridflow report: "
        f"{html.escape(', '.join(r.name for r in runs))}</title><style>{_STYLE}</style></head><body>"
        f"<h1>hybridflow run report</h1>{summary}{note}{''.join(sections)}"
        f"<script type='application/json' id='report-data'>{payload}</script></body></html>"
    )


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
