"""``hybridflow report``: the trainer's timeline and samples, then the HTML/PNG report of one and two runs."""

import json
import re
import shutil
from pathlib import Path

import matplotlib.image
import pytest

import hybridflow.trainer
from hybridflow.commands.cli import main as cli
from hybridflow.commands.report import REPORT_FIGURES, _stage_colors, write_report
from hybridflow.data.prepare import main as prepare_data
from hybridflow.runs.stages import STAGE_ORDER
from hybridflow.runs.tracking import CONSOLE_TIMINGS
from hybridflow.trainer import PPOTrainer, load_config
from hybridflow.trainer.metrics import StepTimings, timer

FIGURES = ("reward", "kl", "entropy", "response_length", "grad_norm", "lr", "stage_times", "timeline")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_path) -> Path:
    """A real 3-step GRPO run on the tiny model: KL loss on (so a reference model), 2 samples shown at
    each validation (before training and after the last step)."""
    data, run = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("run") / "grpo"
    prepare_data(["arithmetic", str(data), "--train-size", "16", "--test-size", "4", "--seed", "0"])
    cfg = load_config(
        [
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"actor_rollout_ref.model.path={tiny_model_path}",
            f"trainer.default_local_dir={run}",
            "data.max_prompt_length=64",
            "data.max_response_length=4",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.total_training_steps=3",
            "trainer.logger=[file]",
            "trainer.log_val_generations=2",
            "trainer.save_freq=2",
        ]
    )
    with PPOTrainer(cfg) as trainer:
        trainer.fit()
    return run


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _embedded(html_path: Path) -> dict:
    match = re.search(
        r"<script type='application/json' id='report-data'>(.*?)</script>", html_path.read_text()
    )
    return json.loads(match[1])


def test_trainer_records_stage_spans_and_validation_samples(run_dir):
    spans = _jsonl(run_dir / "timeline.jsonl")
    assert sorted({s["step"] for s in spans}) == [1, 2, 3]
    after_step = {
        1: [],
        2: ["checkpoint"],
        3: ["validate", "checkpoint"],
    }  # save_freq 2, validation at the end
    for step in (1, 2, 3):
        stages = {s["stage"]: s for s in spans if s["step"] == step}
        assert set(stages) == {"gen", "reward", "ref", "adv", "update_actor", "step", *after_step[step]}
        assert stages["gen"]["group"] == stages["update_actor"]["group"] == "actor_rollout"
        assert stages["ref"]["group"] == "ref" and stages["adv"]["group"] == "driver"
        whole = stages.pop("step")
        ordered = sorted(stages.values(), key=lambda s: s["start"])
        assert [s["stage"] for s in ordered] == [
            "gen",
            "reward",
            "ref",
            "adv",
            "update_actor",
            *after_step[step],
        ]
        inside = ordered[:5]
        for before, after in zip(inside, inside[1:]):  # stages run one after the other, inside the step
            assert whole["start"] <= before["start"] <= before["end"] <= after["start"] <= whole["end"]
        assert all(s["start"] >= whole["end"] for s in ordered[5:])
    timings = {row["step"]: row for row in _jsonl(run_dir / "metrics.jsonl") if "timing_s/gen" in row}
    gen = next(s for s in spans if s["step"] == 2 and s["stage"] == "gen")
    assert gen["end"] - gen["start"] == pytest.approx(timings[2]["timing_s/gen"], abs=1e-3)
    samples = _jsonl(run_dir / "val_generations.jsonl")
    assert [(s["step"], s["index"]) for s in samples] == [(0, 0), (0, 1), (3, 0), (3, 1)]
    assert all(s["prompt"].startswith("Compute ") and isinstance(s["response"], str) for s in samples)


def test_report_writes_html_and_pngs_that_hold_the_plotted_numbers(run_dir, capsys):
    assert cli(["report", str(run_dir)]) == 0
    html_path = run_dir / "report.html"
    assert capsys.readouterr().out.strip() == str(html_path)
    for name in FIGURES:
        image = matplotlib.image.imread(run_dir / "report" / f"{name}.png")
        assert image.shape[0] > 200 and image.shape[1] > 400 and image.std() > 0.01, name  # a drawn picture
    page = html_path.read_text()
    assert page.count("src='data:image/png;base64,") == len(FIGURES)  # self-contained
    assert "http://" not in page and "https://" not in page
    data = _embedded(html_path)
    rows = {row["step"]: row for row in _jsonl(run_dir / "metrics.jsonl")}
    lines = data["figures"]["reward"]["grpo"]
    assert lines["train reward"] == [[s, rows[s]["critic/score/mean"]] for s in (1, 2, 3)]
    assert lines["held-out acc"] == [[s, rows[s]["val/arithmetic/acc/mean@1"]] for s in (0, 3)]
    kl = data["figures"]["kl"]["grpo"]["KL to reference (loss)"]
    assert kl == [[s, rows[s]["actor/kl_loss"]] for s in (1, 2, 3)]
    length = data["figures"]["response_length"]["grpo"]
    assert set(length) == {"mean", "max", "clip ratio"}
    assert data["figures"]["stage_times"]["grpo"]["update_actor"][2] == [3, rows[3]["timing_s/update_actor"]]
    assert {s["step"] for s in data["figures"]["timeline"]["grpo"]} == {1, 2, 3}
    assert data["runs"][0]["checkpoints"] == [2, 3]
    generations = data["generations"]["grpo"]
    assert (generations["before_step"], generations["after_step"]) == (0, 3) and len(generations["rows"]) == 2
    # the numbers are in the page's tables too, not only in the JSON
    assert f"<td>{rows[2]['actor/lr']:.4g}</td>" in page


def test_report_overlays_two_runs_and_reads_a_run_in_progress(run_dir, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(run_dir, live, ignore=shutil.ignore_patterns("report*", "global_step_3"))
    lines = (live / "metrics.jsonl").read_text().splitlines(keepends=True)
    torn = lines[-1][: len(lines[-1]) // 2]  # the last step's line, half written
    (live / "metrics.jsonl").write_text("".join(lines[:-1]) + torn)
    html_path = write_report([run_dir, live], out=tmp_path / "both")
    data = _embedded(html_path)
    assert [r["name"] for r in data["runs"]] == ["grpo", "live"]
    assert data["runs"][1]["checkpoints"] == [2]
    reward = data["figures"]["reward"]
    assert [s for s, _ in reward["grpo"]["train reward"]] == [1, 2, 3]
    assert [s for s, _ in reward["live"]["train reward"]] == [1, 2]  # step 3's torn line skipped
    assert "train reward (live)" in html_path.read_text()
    assert (tmp_path / "both" / "report" / "timeline.png").exists()


def test_report_shows_the_staleness_histogram_of_an_async_run(tmp_path):
    rows = [
        {"step": 1, "async/staleness_count/0": 6.0, "async/staleness_count/1": 2.0},
        {"step": 2, "async/staleness_count/1": 7.0, "async/staleness_count/2": 1.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    html_path = write_report([tmp_path])
    assert _embedded(html_path)["figures"]["staleness_histogram"] == {
        tmp_path.name: {"0": 6.0, "1": 9.0, "2": 1.0}
    }
    assert matplotlib.image.imread(tmp_path / "report" / "staleness.png").shape[0] > 100
    assert "Staleness of the trained samples" in html_path.read_text()


def test_report_on_a_folder_without_metrics_names_it(tmp_path, capsys):
    assert cli(["report", str(tmp_path)]) == 1
    assert f"no metrics.jsonl in folder {tmp_path}" in capsys.readouterr().err


def test_one_vocabulary_of_stages_for_the_timers_the_timeline_and_the_report():
    """Before: ``sync_weights`` was in neither the timeline's table nor the report's order, so the weight sync
    was drawn as the driver's and coloured last; each table listed the stages again."""
    timings = StepTimings()
    with timer("sync_weights", timings):
        pass
    assert [(s["stage"], s["group"]) for s in timings.spans] == [("sync_weights", "rollout")]
    with pytest.raises(
        ValueError, match=r"unknown stage 'sync_weight': add it to hybridflow.runs.stages.STAGES"
    ):
        with timer("sync_weight", timings):
            pass
    # every stage a trainer times is in the table (the timers' names are literals in the trainers' source)
    sources = "".join(p.read_text() for p in Path(hybridflow.trainer.__file__).parent.glob("*.py"))
    timed = set(re.findall(r"\btimer\(\"(\w+)\"", sources))
    assert timed and timed <= set(STAGE_ORDER) and {"sync_weights", "validate", "checkpoint"} <= timed
    # the report colours and stacks them in the order a step runs them, unknown ones (an older run's) after
    colors = _stage_colors(["checkpoint", "custom", "sync_weights", "update_actor", "gen"])
    assert list(colors) == ["gen", "update_actor", "sync_weights", "checkpoint", "custom"]
    assert CONSOLE_TIMINGS == (
        ("gen", "timing_s/gen"),
        ("upd", "timing_s/update_actor"),
        ("upd", "timing_s/update_rm"),
        ("step", "timing_s/step"),
    )


def test_every_figure_of_the_table_is_drawn_tabulated_and_embedded_or_said_missing(tmp_path):
    """``write_report`` draws what ``REPORT_FIGURES`` lists, one entry each, and says which were not logged."""
    rows = [
        {
            "step": s,
            "critic/score/mean": 0.1 * s,
            "actor/entropy": 1.0,
            "timing_s/gen": 1.0,
            "timing_s/step": 2.0,
        }
        for s in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html_path = write_report([tmp_path])
    data, page = _embedded(html_path), html_path.read_text()
    drawn = {f.name for f in REPORT_FIGURES if (tmp_path / "report" / f"{f.png or f.name}.png").exists()}
    assert drawn == set(data["figures"]) == {"reward", "entropy", "stage_times"}
    assert page.count("<details><summary>numbers</summary><table>") == 3
    note = re.search(r"<p>Not logged: (.*?)\.</p>", page)[1].split("; ")
    assert note == [f.missing for f in REPORT_FIGURES if f.name not in drawn and f.missing]
    assert "stage timeline (timeline.jsonl)" in note and "Staleness" not in page  # sync runs have none
