"""Tracking: JSONL lines, resumed files, tensorboard scalars, the console line, backend errors."""

import json
import sys

import numpy as np
import pytest
import torch

from hybridflow.runs.tracking import Tracking, format_step_line


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_file_backend_writes_one_plain_json_object_per_step(tmp_path):
    tracker = Tracking("proj", "exp", "file", tmp_path)
    tracker.log(
        {
            "critic/score/mean": np.float32(0.5),
            "actor/pg_loss": torch.tensor(-0.25),
            "perf/total_num_tokens": np.int64(1200),
            "training/done": True,
        },
        step=1,
    )
    # Flushed each step: readable before finish().
    assert _read_jsonl(tmp_path / "metrics.jsonl") == [
        {
            "step": 1,
            "critic/score/mean": 0.5,
            "actor/pg_loss": -0.25,
            "perf/total_num_tokens": 1200,
            "training/done": 1,
        }
    ]
    tracker.log({"critic/score/mean": 0.75}, step=2)
    tracker.finish()
    lines = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2] and lines[1]["critic/score/mean"] == 0.75
    assert type(lines[0]["perf/total_num_tokens"]) is int


def test_resumed_run_continues_the_file_without_duplicate_steps(tmp_path):
    first = Tracking("p", "e", ["file"], tmp_path)
    for step in (1, 2, 3):
        first.log({"x": float(step)}, step=step)
    first.finish()  # "crashed" after step 3; the last checkpoint was at step 2, so step 3 runs again
    resumed = Tracking("p", "e", ["file"], tmp_path)
    resumed.log({"x": 30.0}, step=3)
    resumed.log({"x": 40.0}, step=4)
    resumed.finish()
    assert _read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 1, "x": 1.0},
        {"step": 2, "x": 2.0},
        {"step": 3, "x": 30.0},
        {"step": 4, "x": 40.0},
    ]


def test_non_numeric_metric_is_an_error_naming_it(tmp_path):
    tracker = Tracking("p", "e", "file", tmp_path)
    with pytest.raises(TypeError, match="metric 'note' must be a number, got str"):
        tracker.log({"note": "hello"}, step=1)
    with pytest.raises(TypeError, match=r"metric 'v' must be one number, got Tensor of shape \(2,\)"):
        tracker.log({"v": torch.ones(2)}, step=1)


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracking("p", "e", ["tensorboard"], tmp_path, config={"trainer": {"seed": 1}})
    tracker.log({"critic/score/mean": 0.25}, step=1)
    tracker.log({"critic/score/mean": 0.5}, step=2)
    tracker.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("critic/score/mean")
    assert [(s.step, s.value) for s in scalars] == [(1, 0.25), (2, 0.5)]


def test_console_line_format():
    metrics = {
        "critic/score/mean": 0.42,
        "critic/rewards/mean": 0.40,
        "actor/ppo_kl": 0.0131,
        "actor/kl_loss": 0.5,
        "actor/kl_ref": 0.0312,
        "actor/pg_loss": -0.1874,
        "critic/vf_loss": 0.021,
        "response_length/mean": 12.5,
        "timing_s/gen": 3.14,
        "timing_s/update_actor": 5.16,
        "timing_s/step": 9.83,
        "timing_s/ref": 1.0,
        "val/arith/acc/mean@1": 0.5,
        "perf/throughput": 123.0,
    }
    assert format_step_line(3, metrics) == (
        "step 3 | reward 0.42 | kl_ref 0.0312 | ppo_kl 0.0131 | pg_loss -0.187 | vf_loss 0.021 | resp_len 12.5 | "
        "gen 3.1s upd 5.2s step 9.8s | val/arith/acc/mean@1 0.5"
    )


def test_console_line_falls_back_and_omits_missing_keys():
    assert (
        format_step_line(
            7, {"critic/rewards/mean": 1.0, "actor/reward_kl_penalty": 0.002, "response_length/mean": 250.4}
        )
        == "step 7 | reward 1 | kl_ref 0.002 | resp_len 250"
    )
    assert format_step_line(0, {"val/arith/reward/mean@1": 0.25}) == "step 0 | val/arith/reward/mean@1 0.25"


def test_console_backend_prints_the_line(tmp_path, capsys):
    tracker = Tracking("p", "e", "console", tmp_path)
    tracker.log({"actor/pg_loss": 0.5}, step=2)
    tracker.finish()
    assert capsys.readouterr().out == "step 2 | pg_loss 0.5\n"
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unknown_backend_is_an_error(tmp_path):
    with pytest.raises(
        ValueError, match=r"unknown logger 'tensorbord' in trainer.logger; known: \['console'"
    ):
        Tracking("p", "e", ["console", "tensorbord"], tmp_path)


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_missing_package_names_the_install_command(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail even where it is installed
    with pytest.raises(
        ImportError,
        match=f"trainer.logger includes '{name}' but the package is not installed: pip install {name}",
    ):
        Tracking("p", "e", ["file", name], tmp_path)


def test_records_go_to_their_own_file_and_resume_like_the_metrics(tmp_path):
    first = Tracking("p", "e", ["console", "file"], tmp_path)
    first.log_records("timeline", [{"stage": "gen", "start": 1.0}, {"stage": "adv", "start": 2.0}], step=1)
    first.log_records("timeline", [{"stage": "gen", "start": 3.0}], step=2)
    first.finish()  # resumed from the step-1 checkpoint: step 2 runs again
    resumed = Tracking("p", "e", ["file"], tmp_path)
    resumed.log_records("timeline", [{"stage": "gen", "start": 4.0}], step=2)
    resumed.finish()
    assert _read_jsonl(tmp_path / "timeline.jsonl") == [
        {"step": 1, "stage": "gen", "start": 1.0},
        {"step": 1, "stage": "adv", "start": 2.0},
        {"step": 2, "stage": "gen", "start": 4.0},
    ]
    assert not (tmp_path / "metrics.jsonl").exists()
    console_only = Tracking("p", "e", ["console"], tmp_path / "c")
    console_only.log_records("timeline", [{"stage": "gen"}], step=1)  # no file logger: nothing written
    assert not (tmp_path / "c").exists()
