"""Faults a user meets, on the tiny model: every bad input gives one ``hybridflow train: error:`` line naming
the culprit (before: a traceback, or a misleading message); a run folder has one owner; a damaged checkpoint,
a torn log line or a kill at any moment never blocks a resume, and a resumed run is bit-identical.

Forked children (not fresh interpreters) play the killed runs and the rival lock holder: they start in
milliseconds, where importing torch and transformers anew takes seconds."""

import json
import os
import random
import shutil
import signal
import time
import traceback
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import run_settings

from hybridflow.commands.cli import main as cli
from hybridflow.data.dataset import read_rows
from hybridflow.runs.checkpoint import LATEST_FILE
from hybridflow.runs.lock import RunLock
from hybridflow.trainer import PPOTrainer, load_config
from hybridflow.trainer.loop import EVENTS

NOT_DETERMINISTIC = ("timing_s/", "perf/time_per_step", "perf/throughput", "perf/reward_share")  # wall clock
STEPS = 3


@pytest.fixture(scope="module")
def data_dir(arithmetic_data) -> Path:
    return arithmetic_data(16, 4)


def overrides(data_dir: Path, model: str, run_dir: Path, *extra: str) -> list[str]:
    """GRPO without a reference model: 3 steps of 4 prompts x 2 samples, a checkpoint every step."""
    return run_settings(
        data_dir,
        model,
        run_dir,
        "algorithm.adv_estimator=grpo",
        "data.max_response_length=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=1",
        *extra,
    )


def logged(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len({row["step"] for row in rows}), "a step was logged twice"
    return {
        row["step"]: {k: v for k, v in row.items() if not k.startswith(NOT_DETERMINISTIC)} for row in rows
    }


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / f"global_step_{STEPS}" / "actor" / "huggingface" / "model.safetensors")


def assert_identical_runs(run_dir: Path, reference: Path) -> None:
    """Every logged number and every final weight equal to the bit."""
    assert logged(run_dir) == logged(reference)
    mine, theirs = final_weights(run_dir), final_weights(reference)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.fixture(scope="module")
def reference(data_dir, tiny_model_path, tmp_path_factory) -> tuple[Path, float]:
    """An uninterrupted run, and how long it took (to aim the random kills inside a run)."""
    run_dir = tmp_path_factory.mktemp("reference")
    start = time.monotonic()
    PPOTrainer(load_config(overrides(data_dir, tiny_model_path, run_dir))).fit()
    return run_dir, time.monotonic() - start


def stopped_after_step_2(reference: Path, run_dir: Path) -> Path:
    """The reference run as a run killed right after step 2's checkpoint would have left it."""
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "global_step_3")
    (run_dir / LATEST_FILE).write_text("2\n")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:2]))
    return run_dir


def resume(args: list[str]) -> list[int]:
    """Run to the end; returns the step it started from."""
    trainer = PPOTrainer(load_config(args))
    starts = []
    trainer.register_hook("on_fit_start", lambda t, step, metrics, batch: starts.append(step))
    trainer.fit()
    return starts


def error_line(capsys, args: list[str]) -> str:
    """``hybridflow train ARGS`` fails with status 2 and, as its last stderr line, one error line."""
    assert cli(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hybridflow train: error: "), err
    return last


# ------------------------------------------------------------------------------------ bad inputs
def _jsonl(path: Path, rows: list, *raw_lines: str) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "".join(raw_lines))
    return str(path)


def bad_inputs(data_dir: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (overrides, what the error line must say). Before, each printed a traceback (a few a
    misleading last line: "all 0 prompts are longer than 64 tokens" for an empty file, "model folder not
    found" for a model path that is a file)."""
    rows = read_rows(data_dir / "train.parquet")
    (tmp / "model.bin").write_text("weights")
    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), tmp / "empty.parquet")
    (tmp / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    (tmp / "half" / "actor").mkdir(parents=True)  # a checkpoint folder whose save never finished
    (tmp / "a_file").write_text("")
    long_prompt = {**rows[0], "prompt": [{"role": "user", "content": "1 + 2 " * 40}]}
    train = "data.train_files="
    return {
        "missing model": (
            ["actor_rollout_ref.model.path=/nowhere/model"],
            "model path not found: /nowhere/model",
        ),
        "model path is a file": (
            [f"actor_rollout_ref.model.path={tmp / 'model.bin'}"],
            f"model path is a file, not a model folder: {tmp / 'model.bin'}",
        ),
        "malformed jsonl": (
            [train + _jsonl(tmp / "bad.jsonl", rows[:1], '{"prompt": [\n')],
            "bad.jsonl: line 2 is not valid JSON",
        ),
        "null prompt": (
            [train + _jsonl(tmp / "null.jsonl", [rows[0], {**rows[1], "prompt": None}])],
            "null.jsonl: row 1: field 'prompt' is missing or null",
        ),
        "missing prompt": (
            [train + _jsonl(tmp / "none.jsonl", [{"data_source": "arithmetic"}])],
            "none.jsonl: row 0: field 'prompt' is missing or null",
        ),
        "over-long prompt, filter off": (
            [
                train + _jsonl(tmp / "long.jsonl", [*rows[:4], long_prompt]),
                "data.filter_overlong_prompts=false",
            ],
            "long.jsonl: row 4: prompt has",
        ),
        "empty jsonl": ([train + _jsonl(tmp / "empty.jsonl", [])], "empty.jsonl: the file has no rows"),
        "empty parquet": ([train + str(tmp / "empty.parquet")], "empty.parquet: the file has no rows"),
        "missing reward file": (
            [f"custom_reward_function.path={tmp / 'nope.py'}"],
            "custom_reward_function.path: reward file not found",
        ),
        "missing reward function": (
            [f"custom_reward_function.path={tmp / 'reward.py'}", "custom_reward_function.name=score_it"],
            "has no function 'score_it'; it defines ['compute_score']",
        ),
        "missing resume path": (
            ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp / 'gone'}"],
            f"trainer.resume_from_path {tmp / 'gone'} does not exist",
        ),
        "half-written resume path": (
            ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp / 'half'}"],
            "has no COMPLETE marker",
        ),
        # Running as root here, so a read-only folder would still be writable: a folder below a file fails
        # the same first write.
        "unwritable output folder": (
            [f"trainer.default_local_dir={tmp / 'a_file' / 'run'}"],
            f"cannot write to trainer.default_local_dir {tmp / 'a_file' / 'run'}",
        ),
    }


BAD_INPUTS = [
    "missing model",
    "model path is a file",
    "malformed jsonl",
    "null prompt",
    "missing prompt",
    "over-long prompt, filter off",
    "empty jsonl",
    "empty parquet",
    "missing reward file",
    "missing reward function",
    "missing resume path",
    "half-written resume path",
    "unwritable output folder",
]


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_a_bad_input_gives_one_line_naming_it(name, data_dir, tiny_model_path, tmp_path, capsys):
    extra, expected = bad_inputs(data_dir, tmp_path)[name]
    line = error_line(capsys, overrides(data_dir, tiny_model_path, tmp_path / "run", *extra))
    assert expected in line


def test_every_command_prints_an_input_error_as_one_line(tmp_path, capsys):
    assert cli(["generate", "--model", str(tmp_path / "nothing"), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == (
        f"hybridflow generate: error: {tmp_path / 'nothing'} is neither a model "
        "folder, a LoRA adapter folder, a checkpoint, nor a run folder with a complete "
        "checkpoint\n"
    )
    assert cli(["prepare-data", "arithmetic", str(tmp_path), "--train-size", "-1"]) == 2
    assert capsys.readouterr().err.startswith("hybridflow prepare-data: error: sizes must be non-negative")


def test_debug_shows_the_traceback(data_dir, tiny_model_path, tmp_path):
    from hybridflow.utils.errors import MissingInputError

    with pytest.raises(MissingInputError, match="model path not found"):
        cli(
            [
                "train",
                "--debug",
                *overrides(data_dir, tiny_model_path, tmp_path, "actor_rollout_ref.model.path=/x/y"),
            ]
        )


@pytest.mark.parametrize("returned", ["'1.0'", "None", "[1.0]", "{'acc': 1.0}"])
def test_a_reward_function_must_return_a_number(returned, data_dir, tiny_model_path, tmp_path, capsys):
    """Before: "could not convert string to float" without the function, sample or type, and "1.0" accepted."""
    (tmp_path / "reward.py").write_text(
        f"def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {returned}\n"
    )
    line = error_line(
        capsys,
        overrides(
            data_dir,
            tiny_model_path,
            tmp_path / "run",
            f"custom_reward_function.path={tmp_path / 'reward.py'}",
            "custom_reward_function.name=my_score",
        ),
    )
    assert "reward function my_score on sample 0 (data_source 'arithmetic', response " in line
    assert ("without 'score'" if "acc" in returned else f"returned {type(eval(returned)).__name__} ") in line
    assert "a score is a number (bool, int, float or a 0-d tensor) or a dict with a numeric 'score'" in line


def test_a_huge_learning_rate_stops_at_the_update_that_broke_the_weights(
    data_dir, tiny_model_path, tmp_path, capsys
):
    """Before: "probability tensor contains either inf, nan or element < 0" from inside generate."""
    line = error_line(
        capsys, overrides(data_dir, tiny_model_path, tmp_path, "actor_rollout_ref.actor.optim.lr=1e15")
    )
    assert line == (
        "hybridflow train: error: the model's next-token scores are not finite (inf or NaN): the update "
        "of training step 1 (lr 1e+15) broke the weights; lower actor_rollout_ref.actor.optim.lr"
    )


def test_ray_workers_with_no_cpu_free_are_refused_up_front(
    data_dir, tiny_model_path, tmp_path, capsys, ray_session
):
    """Before: Ray's resource message after the placement timed out (about 70 s). More workers than CPUs
    now share the CPUs (tests/trainer/test_placement.py); only a Ray whose CPUs are all held is refused."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    held = placement_group([{"CPU": ray.cluster_resources()["CPU"]}])
    assert held.wait(120)
    groups_before = set(placement_group_table())
    try:
        line = error_line(
            capsys,
            overrides(data_dir, tiny_model_path, tmp_path, "trainer.backend=ray", "trainer.n_workers=2"),
        )
        # refused before it reserved anything (a placement group left pending is what timed out before),
        # checked by the cluster's state, not by a clock
        assert set(placement_group_table()) == groups_before
    finally:
        remove_placement_group(held)
    assert (
        "trainer.n_workers=2 with trainer.placement=colocated starts 2 worker processes, but Ray sees 0 CPUs "
        "available (of 2); other Ray work holds 2" in line
    )


# ------------------------------------------------------------------------------------ the run folder
def test_a_second_run_on_a_folder_is_refused_and_a_killed_holder_leaves_no_lock(
    data_dir, tiny_model_path, tmp_path, capsys
):
    """Before: both runs exited 0, interleaving their checkpoints and log lines."""
    run_dir = tmp_path / "run"
    ready, tell = os.pipe()
    holder = os.fork()
    if holder == 0:  # the first run: takes the lock and works until killed
        try:
            lock = RunLock(
                run_dir
            )  # kept referenced: a collected RunLock closes its file, releasing the lock
            lock.acquire()
            os.write(tell, b"1")
            time.sleep(120)
        finally:
            os._exit(0)
    assert os.read(ready, 1) == b"1"
    try:
        line = error_line(capsys, overrides(data_dir, tiny_model_path, run_dir))
        assert f"{run_dir} is in use by another run (pid {holder} on " in line
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    with RunLock(run_dir):  # the operating system dropped the dead holder's lock
        pass


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one(
    reference, data_dir, tiny_model_path, tmp_path
):
    """Before: "SafetensorError: incomplete metadata" stopped every auto-resume."""
    run_dir = stopped_after_step_2(reference[0], tmp_path / "run")
    with open(run_dir / "global_step_2" / "actor" / "huggingface" / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    assert resume(overrides(data_dir, tiny_model_path, run_dir)) == [1]
    assert (run_dir / "global_step_2.damaged").is_dir()
    assert_identical_runs(run_dir, reference[0])


def test_a_damaged_checkpoint_without_a_manifest_is_named(
    reference, data_dir, tiny_model_path, tmp_path, capsys
):
    """A checkpoint saved before manifests (plain-text marker) cannot be verified up front: reading it says
    which file is damaged, in one line."""
    run_dir = stopped_after_step_2(reference[0], tmp_path / "run")
    (run_dir / "global_step_2" / "COMPLETE").write_text("saved at 2025-01-01 00:00:00\n")
    weights = run_dir / "global_step_2" / "actor" / "huggingface" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(1000)
    line = error_line(capsys, overrides(data_dir, tiny_model_path, run_dir))
    assert (
        f"{weights} cannot be read (" in line
        and "the checkpoint is damaged; resume from an earlier one" in line
    )


def test_a_torn_metrics_line_is_dropped(reference, data_dir, tiny_model_path, tmp_path, caplog):
    """Before: JSONDecodeError on every later resume."""
    run_dir = stopped_after_step_2(reference[0], tmp_path / "run")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "critic/score/mean": 0.')  # the process died mid-line
    assert resume(overrides(data_dir, tiny_model_path, run_dir)) == [2]
    assert "metrics.jsonl: dropped line 3 of 3, which is not a complete JSON object" in caplog.text
    assert_identical_runs(run_dir, reference[0])


def test_resuming_with_another_batch_size_is_refused(reference, data_dir, tiny_model_path, tmp_path, capsys):
    run_dir = stopped_after_step_2(reference[0], tmp_path / "run")
    line = error_line(capsys, overrides(data_dir, tiny_model_path, run_dir, "data.train_batch_size=8"))
    assert (
        f"cannot resume from {run_dir / 'global_step_2'}: it was saved with other data settings "
        "(data.train_batch_size 4 -> 8)" in line
    )


def test_changed_settings_apply_on_resume_and_are_logged(
    reference, data_dir, tiny_model_path, tmp_path, caplog
):
    """Before: the checkpoint's learning rate (and fixed KL coefficient) was kept, silently."""
    run_dir = stopped_after_step_2(reference[0], tmp_path / "run")
    resume(
        overrides(
            data_dir,
            tiny_model_path,
            run_dir,
            "actor_rollout_ref.actor.optim.lr=2e-3",
            "algorithm.kl_ctrl.kl_coef=0.005",
        )
    )
    mine, theirs = logged(run_dir)[3], logged(reference[0])[3]
    assert (mine["actor/lr"], theirs["actor/lr"]) == (2e-3, 1e-3)
    assert (mine["training/kl_coef"], theirs["training/kl_coef"]) == (0.005, 0.001)
    assert (
        "actor: resuming with lr 0.002 instead of the checkpoint's 0.001: applied from this step on"
        in caplog.text
    )
    assert "resuming with algorithm.kl_ctrl.kl_coef 0.005 instead of the checkpoint's 0.001" in caplog.text


def killed_at_event(args: list[str], event: int) -> None:
    """In a forked child: run, and SIGKILL this process at its ``event``-th moment of interest: every
    trainer stage (hooks) and every fsync, rename and replace of the checkpoint code (inside a save, right
    after its commit, while recording the latest step or pruning). Exits 0 if the run ends first."""
    count = 0

    def tick(*_: object) -> None:
        nonlocal count
        count += 1
        if count == event:
            os.kill(os.getpid(), signal.SIGKILL)

    def counted(fn):
        def wrapper(*a, **kw):
            tick()
            return fn(*a, **kw)

        return wrapper

    code = 1
    try:
        for name in ("fsync", "rename", "replace"):
            setattr(os, name, counted(getattr(os, name)))
        trainer = PPOTrainer(load_config(args))
        for hook_event in EVENTS:
            trainer.register_hook(hook_event, tick)
        trainer.fit()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def test_a_run_killed_at_random_moments_resumes_bit_identically(
    reference, data_dir, tiny_model_path, tmp_path
):
    """SIGKILL at seeded random moments (a 3-step run has about 100 of them: stages, and the fsyncs and
    renames of saving, committing, recording and pruning), a resume after each; the finished run logs the
    same numbers and holds the same weights as the uninterrupted one."""
    run_dir = tmp_path / "run"
    args = overrides(data_dir, tiny_model_path, run_dir, "trainer.max_ckpt_to_keep=2")
    rng = random.Random(1234)
    killed = []
    for _ in range(4):
        event = rng.randint(1, 40)
        child = os.fork()
        if child == 0:
            killed_at_event(args, event)
        _, status = os.waitpid(child, 0)
        assert status in (0, signal.SIGKILL), f"the run failed on its own: status {status}"
        killed.append(status == signal.SIGKILL)
    assert all(killed), killed  # the events are deterministic: each of these moments comes in the run
    resume(args)
    assert_identical_runs(run_dir, reference[0])
    assert not list(run_dir.glob(".tmp-*"))
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_2", "global_step_3"]


def test_ray_workers_that_cannot_load_their_model_give_their_cpus_back(
    data_dir, tiny_model_path, tmp_path, ray_session
):
    """Before: a worker whose ``init_model`` raised left every placement group of the run reserved, so the
    next run on the same Ray waited for CPUs it would never get. Checked by the cluster's state."""
    from ray.util.placement_group import placement_group_table

    model = tmp_path / "no_weights"  # the driver reads its tokenizer; the workers find no weights to load
    shutil.copytree(tiny_model_path, model, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    reserved = {k for k, g in placement_group_table().items() if g["state"] != "REMOVED"}
    config = load_config(
        overrides(data_dir, str(model), tmp_path / "run", "trainer.backend=ray", "trainer.n_workers=2")
    )
    with pytest.raises(Exception, match="no_weights"):
        with PPOTrainer(config) as trainer:
            trainer.init_workers()
    assert {k for k, g in placement_group_table().items() if g["state"] != "REMOVED"} == reserved
