"""verl's GSM8K GRPO example script (examples/verl_grpo_gsm8k.sh: verl's run_qwen2-7b.sh with only the
module name changed) parses to the settings it names and trains on the tiny model, given GSM8K data made
by ``hybridflow prepare-data gsm8k`` where verl's script looks for it ($HOME/data/gsm8k)."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hybridflow.commands.cli import main as cli
from hybridflow.config.schema import IgnoredKeyWarning, load_config

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "verl_grpo_gsm8k.sh"
# what a CPU machine without vLLM or wandb appends, and sizes for the tiny model (the script ends in $@)
CPU_TAIL = [
    "actor_rollout_ref.rollout.name=hf",
    "trainer.logger=[console,file]",
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # 8 prompts x n=5: one micro-batch of 40
    "data.max_response_length=16",
    "trainer.total_training_steps=1",
    "trainer.val_before_train=false",
]


def run_script(
    home: Path, cwd: Path, *tail: str, model: str = "MODEL", bin_dir: Path | None = None
) -> subprocess.CompletedProcess:
    path = f"{bin_dir or Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "HOME": str(home), "PATH": path, "OMP_NUM_THREADS": "1", "MODEL_PATH": model}
    return subprocess.run(
        ["bash", str(SCRIPT), *tail], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def gsm8k_data(home: Path) -> None:
    rows = [
        {
            "question": f"Tom has {a} apples and buys {a + 2} more. How many now?",
            "answer": f"#### {2 * a + 2}",
        }
        for a in range(16)
    ]
    source = home / "gsm8k.jsonl"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = home / "data" / "gsm8k"
    assert cli(["prepare-data", "gsm8k", str(out), "--source", str(source), "--test-fraction", "0.25"]) == 0


def test_the_script_parses_to_the_settings_it_names(tmp_path):
    """What the shell hands python3 (a stand-in python3 records it), loaded as our config."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    recorder = bin_dir / "python3"
    recorder.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'argv.txt'}\n")
    recorder.chmod(0o755)
    assert run_script(tmp_path / "home", tmp_path, bin_dir=bin_dir).returncode == 0
    argv = (tmp_path / "argv.txt").read_text().splitlines()
    assert argv[:2] == ["-m", "hybridflow.trainer.main_ppo"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(argv[2:])
    ignored = sorted(
        str(w.message).split(": ")[1].split(" = ")[0] for w in caught if w.category is IgnoredKeyWarning
    )
    assert ignored == [  # GPU-only settings, each named with why
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "trainer.n_gpus_per_node",
    ]
    arr = cfg.actor_rollout_ref
    assert cfg.data.train_files == [str(tmp_path / "home/data/gsm8k/train.parquet")]
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.use_kl_in_reward is False
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (
        1024,
        512,
        1024,
    )
    assert arr.model.path == "MODEL" and arr.actor.optim.lr == 1e-6 and arr.rollout.n == 5
    assert (arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_gpu) == (256, 40)
    assert (
        arr.actor.use_kl_loss and arr.actor.kl_loss_coef == 0.001 and arr.actor.kl_loss_type == "low_var_kl"
    )
    assert arr.rollout.name == "vllm" and cfg.trainer.logger == ["console", "wandb"]
    assert arr.model.use_remove_padding  # padding-free rows, as in verl
    assert (cfg.trainer.project_name, cfg.trainer.experiment_name) == (
        "verl_grpo_example_gsm8k",
        "qwen2_7b_function_rm",
    )
    assert (cfg.trainer.save_freq, cfg.trainer.test_freq, cfg.trainer.total_epochs) == (20, 5, 15)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_script_trains_a_step_on_the_tiny_model(tmp_path, tiny_model_path):
    home = tmp_path / "home"
    gsm8k_data(home)
    done = run_script(home, tmp_path, *CPU_TAIL, model=tiny_model_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "verl_grpo_example_gsm8k" / "qwen2_7b_function_rm"
    assert (run / "global_step_1" / "actor" / "huggingface" / "config.json").is_file()  # saved at the end
    (step,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert step["step"] == 1 and step["training/global_step"] == 1
    assert step["response_length/max"] <= 16 and "actor/kl_loss" in step  # use_kl_loss=True, low_var_kl
    # validation after the last step, under verl's data_source name, scored by verl's strict GSM8K rule
    assert "val/openai/gsm8k/reward/mean@1" in step
