"""Running it for real, on the tiny model and the local backend: a resumed run repeats the uninterrupted one,
checkpoints load with plain transformers, a save killed by SIGKILL leaves the previous checkpoint in charge,
JSONL and TensorBoard logs, validation metrics, and the ``hybridflow`` command line end to end."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_runs import run_settings
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybridflow
from hybridflow.commands.cli import main as cli
from hybridflow.runs.checkpoint import COMPLETE_MARKER, LATEST_FILE, resolve_checkpoint
from hybridflow.runs.trained_model import chat
from hybridflow.trainer import PPOTrainer, load_config
from hybridflow.trainer.loop import HookError

SUBPROCESS_ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
BIN = Path(sys.executable).parent  # the venv's bin folder, holding the `hybridflow` console script
NOT_DETERMINISTIC = ("timing_s/", "perf/time_per_step", "perf/throughput", "perf/reward_share")  # wall clock
ESTIMATORS = {
    "grpo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true"],
    # A critic, two PPO epochs and an adaptive KL coefficient: more state that a resume must bring back.
    "gae": [
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=10",
        "actor_rollout_ref.actor.ppo_epochs=2",
    ],
}
# Sampled validation draws random numbers too (between training steps when test_freq=1), so a resume that
# restored the weights but not the random state would sample other responses.
SAMPLED_VALIDATION = [
    f"actor_rollout_ref.rollout.val_kwargs.{setting}"
    for setting in ("n=2", "do_sample=true", "temperature=1.0")
]
STEP_METRICS = [
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/lr",
    "actor/kl_loss",
    "response_length/mean",
    "training/global_step",
    "training/kl_coef",
    "timing_s/step",
    "perf/throughput",
]
VAL_METRICS = ["val/arithmetic/reward/mean@2", "val/arithmetic/acc/mean@2", "val/arithmetic/pass@2"]

# Depends on every character of the response, so any difference in the sampled text shows in the rewards,
# advantages and losses (the arithmetic scorer gives a random tiny model 0 almost always).
TEXT_HASH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 7 / 6
"""

KILLED_DURING_SAVE = '''
import sys, time
from pathlib import Path

import torch

import hybridflow.workers.actor as actor
from hybridflow.trainer import PPOTrainer, load_config

marker, overrides = Path(sys.argv[1]), sys.argv[2:]
write_actor_files = actor.save_worker_state


def write_then_hang(path, *args, **kwargs):
    """Step 2's actor files land in the temporary folder, then the process hangs until it is killed."""
    write_actor_files(path, *args, **kwargs)
    if "global_step_2" in str(path):
        marker.write_text(str(path))
        time.sleep(600)


actor.save_worker_state = write_then_hang
torch.set_num_threads(1)  # as in the test process, so the float reductions match the resumed run's
PPOTrainer(load_config(overrides)).fit()
'''


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model's operations are too small to split: a second thread only adds synchronisation, which
    made these runs about 10x slower when other processes kept the 2 cores busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data_dir(arithmetic_data) -> Path:
    return arithmetic_data(32, 4)


def overrides(data_dir: Path, model: str, run_dir: Path, *extra: str) -> list[str]:
    return run_settings(
        data_dir,
        model,
        run_dir,
        f"data.val_files={data_dir / 'test.parquet'}",
        "data.max_response_length=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        *extra,
    )


def logged(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged twice (a resume that did not drop its stale line) fails."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), f"steps logged more than once: {steps}"
    return {row["step"]: row for row in rows}


def checkpoints(run_dir: Path) -> list[int]:
    """Steps of the ``global_step_N`` folders (complete or not)."""
    return sorted(int(p.name.rpartition("_")[2]) for p in run_dir.glob("global_step_*"))


def deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(NOT_DETERMINISTIC)}


class Stop(RuntimeError):
    pass


def stop_after_checkpoint(step: int):
    """A hook that ends ``fit`` right after ``step``'s checkpoint, like a job whose time ran out."""

    def hook(trainer, at_step, metrics, batch):
        if at_step == step:
            raise Stop(f"stopped after the checkpoint of step {step}")

    return hook


def actor_module(trainer: PPOTrainer) -> torch.nn.Module:
    """The live actor model of a local-backend trainer (its one worker lives in this process)."""
    return trainer.wg.actor_rollout.workers[0].role_workers["actor_rollout"].module


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"weights differ: {different[:5]}"


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_resumed_run_repeats_the_uninterrupted_one(estimator, data_dir, tiny_model_path, tmp_path):
    (tmp_path / "reward.py").write_text(TEXT_HASH_REWARD)
    extra = [
        *ESTIMATORS[estimator],
        *SAMPLED_VALIDATION,
        "trainer.test_freq=1",
        f"custom_reward_function.path={tmp_path / 'reward.py'}",
    ]
    PPOTrainer(load_config(overrides(data_dir, tiny_model_path, tmp_path / "a", *extra))).fit()

    interrupted = PPOTrainer(load_config(overrides(data_dir, tiny_model_path, tmp_path / "b", *extra)))
    interrupted.register_hook("on_checkpoint", stop_after_checkpoint(2))
    with pytest.raises(HookError, match="stopped after the checkpoint of step 2"):
        interrupted.fit()
    assert checkpoints(tmp_path / "b") == [1, 2]

    resumed = PPOTrainer(load_config(overrides(data_dir, tiny_model_path, tmp_path / "b", *extra)))
    starts = []
    resumed.register_hook("on_fit_start", lambda trainer, step, metrics, batch: starts.append(step))
    last = resumed.fit()
    assert starts == [2]

    a, b = logged(tmp_path / "a"), logged(tmp_path / "b")
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for key in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/lr",
        "response_length/mean",
        "val/arithmetic/reward/mean@2",
        "val/arithmetic/pass@2",
    ):
        assert key in b[3], key
    assert len({a[step]["critic/score/mean"] for step in (1, 2, 3)}) == 3  # the reward does vary
    if estimator == "gae":  # the adaptive coefficient moved, so its restore is tested
        assert b[3]["training/kl_coef"] != 0.001
        assert "critic/vf_loss" in b[3] and "critic/grad_norm" in b[3]
    assert deterministic(b[3]).keys() == deterministic(a[3]).keys()
    assert deterministic(b[3]) == pytest.approx(deterministic(a[3]), rel=0, abs=1e-6)
    assert deterministic(last) == pytest.approx(
        {k: v for k, v in deterministic(a[3]).items() if k != "step"}, rel=0, abs=1e-6
    )


# ------------------------------------------------------------------------------------------ a finished run
@pytest.fixture(scope="module")
def finished_run(data_dir, tiny_model_path, tmp_path_factory) -> tuple[PPOTrainer, Path]:
    """GRPO, 3 steps, a checkpoint each step keeping the newest 2, sampled validation (n=2) before training,
    at step 2 (test_freq) and at the end, logged to JSONL and TensorBoard."""
    run_dir = tmp_path_factory.mktemp("finished")
    trainer = PPOTrainer(
        load_config(
            overrides(
                data_dir,
                tiny_model_path,
                run_dir,
                *ESTIMATORS["grpo"],
                *SAMPLED_VALIDATION,
                "trainer.test_freq=2",
                "trainer.max_ckpt_to_keep=2",
                "trainer.logger=[file,tensorboard]",
            )
        )
    )
    trainer.fit()
    return trainer, run_dir


def test_checkpoint_is_a_plain_hugging_face_folder(finished_run):
    trainer, run_dir = finished_run
    folder = run_dir / "global_step_3" / "actor" / "huggingface"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert_same_weights(model, actor_module(trainer))

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(
        **inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    assert out.shape == (1, inputs["input_ids"].shape[1] + 3)

    step = run_dir / "global_step_3"
    optim = torch.load(step / "actor" / "optim.pt", weights_only=False)
    assert optim["scheduler"]["last_epoch"] == 3  # one schedule step per training step
    assert len(optim["optimizer"]["state"]) == len(list(model.parameters()))  # AdamW moments of every tensor
    assert (step / "actor" / "rng_rank0.pt").is_file()
    state = torch.load(step / "trainer_state.pt", weights_only=False)
    assert state["global_step"] == 3
    assert (state["loader"]["epoch"], state["loader"]["position"]) == (0, 3)  # 3 of the epoch's 8 batches


def test_only_the_newest_complete_checkpoints_are_kept(finished_run):
    _, run_dir = finished_run
    assert checkpoints(run_dir) == [2, 3]
    assert all((p / COMPLETE_MARKER).is_file() for p in run_dir.glob("global_step_*"))
    assert (run_dir / LATEST_FILE).read_text().strip() == "3"
    assert not list(run_dir.glob(".tmp-*"))


def test_load_trained_actor_takes_the_newest_complete_checkpoint(finished_run, tmp_path):
    trainer, run_dir = finished_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("tensorboard"))
    # A newer folder without the COMPLETE marker (as a crash could leave), holding step 2's weights.
    shutil.copytree(run / "global_step_2", run / "global_step_9")
    (run / "global_step_9" / COMPLETE_MARKER).unlink()

    model, tokenizer = hybridflow.load_trained_actor(run)
    assert_same_weights(model, actor_module(trainer))  # step 3's weights, not step 9's (= step 2's)
    step2 = AutoModelForCausalLM.from_pretrained(run / "global_step_2" / "actor" / "huggingface")
    assert not torch.equal(step2.lm_head.weight, model.lm_head.weight)
    assert tokenizer.eos_token == "<|im_end|>"


def test_every_step_is_logged_to_jsonl_and_tensorboard(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = finished_run
    rows = logged(run_dir)
    assert sorted(rows) == [0, 1, 2, 3]
    assert sorted(rows[0]) == sorted(["step", *VAL_METRICS])  # validation before training only
    for step in (1, 2, 3):
        expected = STEP_METRICS + (VAL_METRICS if step in (2, 3) else [])  # test_freq=2 and the end
        assert [k for k in expected if k not in rows[step]] == []
        assert all(math.isfinite(v) for v in rows[step].values())
    assert "val/arithmetic/pass@2" not in rows[1]

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in ("critic/score/mean", "actor/grad_norm", *VAL_METRICS):
        assert key in tags
        written = {e.step: e.value for e in events.Scalars(key)}
        assert written == pytest.approx({s: row[key] for s, row in rows.items() if key in row}, rel=1e-6)


def test_validation_reports_mean_and_pass_at_n(finished_run):
    _, run_dir = finished_run
    for row in logged(run_dir).values():
        if "val/arithmetic/pass@2" in row:
            mean_acc, pass_at_2 = row["val/arithmetic/acc/mean@2"], row["val/arithmetic/pass@2"]
            # 4 prompts x 2 samples: accuracies are multiples of 1/8, pass@2 of 1/4, and a prompt with a
            # correct sample passes, so pass@2 is at least the mean accuracy.
            assert (mean_acc * 8).is_integer() and (pass_at_2 * 4).is_integer()
            assert mean_acc <= pass_at_2 <= min(1.0, 2 * mean_acc)
            assert 0.0 <= row["val/arithmetic/reward/mean@2"] <= 1.0


# ---------------------------------------------------------------------------------------------- SIGKILL
def test_run_killed_during_a_save_resumes_from_the_previous_checkpoint(data_dir, tiny_model_path, tmp_path):
    run_dir, marker, script = tmp_path / "run", tmp_path / "saving", tmp_path / "killed_during_save.py"
    script.write_text(KILLED_DURING_SAVE)
    args = overrides(data_dir, tiny_model_path, run_dir, *ESTIMATORS["grpo"])
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(marker), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=SUBPROCESS_ENV,
        )
        try:
            deadline = time.monotonic() + 180
            while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            log = (tmp_path / "out.txt").read_text()
            assert marker.exists(), f"step 2's save never started:\n{log[-3000:]}"
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    assert checkpoints(run_dir) == [1]
    leftover = run_dir / f".tmp-global_step_2-{proc.pid}"
    assert (leftover / "actor" / "huggingface" / "config.json").is_file()  # half written...
    assert not (leftover / COMPLETE_MARKER).exists()  # ...and never marked complete
    assert (run_dir / LATEST_FILE).read_text().strip() == "1"
    killed_step_2 = logged(run_dir)[2]  # logged before the save began

    with pytest.raises(FileNotFoundError, match="no COMPLETE marker"):  # never taken as a resume path
        resolve_checkpoint(leftover)
    assert resolve_checkpoint(run_dir) == run_dir / "global_step_1"

    resumed = PPOTrainer(load_config(args))  # resume_mode=auto
    starts = []
    resumed.register_hook("on_fit_start", lambda trainer, step, metrics, batch: starts.append(step))
    resumed.fit()
    assert starts == [1]
    assert not leftover.exists()  # removed by the resumed run: its process is dead
    rows = logged(run_dir)
    assert sorted(rows) == [0, 1, 2, 3]  # the killed run's step-2 line was replaced, not duplicated
    assert deterministic(rows[2]) == pytest.approx(deterministic(killed_step_2), rel=0, abs=1e-6)
    assert checkpoints(run_dir) == [1, 2, 3]
    assert not list(run_dir.glob(".tmp-*"))


# ------------------------------------------------------------------------------------------ the command line
def step_heads(stdout: str) -> list[str]:
    """``step N`` of every compact console line."""
    return [line.split(" | ")[0] for line in stdout.splitlines() if line.startswith("step ")]


def run_command(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=SUBPROCESS_ENV)
    output = f"{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{cmd[:3]} exited with {done.returncode}:\n{output}"
    return done


def test_command_line_end_to_end(tmp_path):
    data, model, run = tmp_path / "data", tmp_path / "model", tmp_path / "run"
    assert cli(["prepare-data", "arithmetic", str(data), "--train-size", "16", "--test-size", "4"]) == 0
    assert cli(["make-tiny-model", str(model)]) == 0
    assert (data / "train.parquet").is_file() and (model / "config.json").is_file()

    args = overrides(
        data,
        str(model),
        run,
        *ESTIMATORS["grpo"],
        "trainer.logger=[console,file]",
        "trainer.save_freq=-1",
        "trainer.total_training_steps=2",
    )
    trained = run_command([str(BIN / "hybridflow"), "train", *args], tmp_path)
    assert step_heads(trained.stdout) == ["step 0", "step 1", "step 2"]  # validation, then 2 steps
    step_lines = [line for line in trained.stdout.splitlines() if line.startswith("step ")]
    # no ppo_kl: data used once, on-policy, has a ratio of exactly 1 (a KL of 0 by construction)
    compact = (
        r"step 1 \| reward \S+ \| kl_ref \S+ \| pg_loss \S+ \| resp_len \S+ \| gen \S+s upd \S+s step \S+s"
    )
    assert re.fullmatch(compact, step_lines[1]), step_lines[1]
    assert checkpoints(run) == [2]  # save_freq=-1: saved at the end only

    # The module entry point, told to go one step further, resumes the finished run instead of restarting.
    more = [a.replace("total_training_steps=2", "total_training_steps=3") for a in args]
    extended = run_command([sys.executable, "-m", "hybridflow.trainer.main_ppo", *more], tmp_path)
    assert step_heads(extended.stdout) == ["step 3"]
    assert f"resumed from {run / 'global_step_2'} at step 2" in extended.stderr
    assert (run / "global_step_3" / COMPLETE_MARKER).is_file()

    prompt = "What is 2+3?"
    answered = run_command(
        [
            str(BIN / "hybridflow"),
            "generate",
            "--model",
            str(run),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "6",
        ],
        tmp_path,
    )
    expected = chat(*hybridflow.load_trained_actor(run), prompt, max_new_tokens=6)  # greedy: deterministic
    assert answered.stdout == f">>> {prompt}\n{expected}\n"


def test_train_with_an_unknown_key_names_the_nearest_one(capsys):
    assert cli(["train", "trainer.total_training_step=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'trainer.total_training_step'" in err
    assert "did you mean 'trainer.total_training_steps'" in err
