"""``hybridflow doctor``: every check passes on a good (and the demo's) configuration and fails on its own
crafted bad input; the memory estimate's arithmetic by hand."""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from hybridflow.commands.cli import main as cli
from hybridflow.commands.demo import DEMO_SETTINGS
from hybridflow.commands.doctor import run_checks
from hybridflow.commands.memory_estimate import (
    GB,
    RUNTIME_BYTES,
    ModelShape,
    estimate_memory,
    knob,
    model_shape,
)
from hybridflow.config.schema import load_config, load_unvalidated
from hybridflow.models.tiny import make_tiny_model
from hybridflow.rewards import RewardManager, load_custom_reward_function
from hybridflow.utils.errors import UserError

NAMES = ["config", "paths", "model", "support", "dataset", "batch", "reward", "memory", "environment"]


@pytest.fixture(scope="module")
def data_dir(arithmetic_data) -> Path:
    return arithmetic_data(16, 4)


@pytest.fixture
def base(data_dir, tiny_model_path, tmp_path) -> list[str]:
    return [
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.val_files={data_dir / 'test.parquet'}",
        f"actor_rollout_ref.model.path={tiny_model_path}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "data.max_prompt_length=96",
        "data.max_response_length=8",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "algorithm.adv_estimator=grpo",
    ]


def verdicts(overrides: list[str], **kw) -> dict[str, object]:
    return {c.name: c for c in run_checks(overrides, **kw)}


def failed(checks: dict) -> list[str]:
    return [name for name, c in checks.items() if c.verdict == "fail"]


def test_good_config_passes_every_check_and_exits_0(base, tiny_model_path, capsys):
    assert cli(["doctor", *base]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[:9]] == NAMES and all(
        line.startswith("ok") for line in lines[:9]
    )
    assert lines[-1] == "9 checks: 9 ok"
    assert cli(["doctor", "--json", *base]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and [c["name"] for c in report["checks"]] == NAMES
    dataset = next(c for c in report["checks"] if c["name"] == "dataset")
    assert dataset["data"]["rows"] == 16 and dataset["data"]["over"] == 0
    assert dataset["data"]["p50"] <= dataset["data"]["max"] <= 96
    # the memory estimate is for the longest prompt read (batches are trimmed to it), not for 96 tokens
    memory = next(c for c in report["checks"] if c["name"] == "memory")
    cfg = load_config(base)
    shape = model_shape(AutoConfig.from_pretrained(tiny_model_path), tiny_model_path)
    assert shape.streams_checkpoint  # its safetensors hold every parameter under its name
    longest = estimate_memory(cfg, shape, 1, prompt_tokens=dataset["data"]["max"])
    assert dataset["data"]["max"] < 96 and memory["data"]["passes"] == longest.passes


def test_the_demo_settings_pass(data_dir, tiny_model_path, tmp_path):
    """The demo's own settings (batch sizes, lengths, samples, validation), on the tiny model for speed."""
    checks = verdicts(
        [
            f"data.train_files={data_dir / 'train.parquet'}",
            f"data.val_files={data_dir / 'test.parquet'}",
            f"actor_rollout_ref.model.path={tiny_model_path}",
            f"trainer.default_local_dir={tmp_path}",
            *DEMO_SETTINGS,
        ]
    )
    assert {name: c.verdict for name, c in checks.items()} == dict.fromkeys(NAMES, "ok")
    assert "8 prompts x 4 = 32 sequences per step" in checks["batch"].detail


def test_wrong_batch_size_fails_the_batch_check(base, capsys):
    assert cli(["doctor", *base, "data.train_batch_size=6"]) == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.split()[1] == "batch")
    assert (
        line.startswith("FAIL")
        and "not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size (4)" in line
    )
    assert "-> fix:" in line
    assert failed(verdicts([*base, "data.train_batch_size=6"])) == ["batch"]
    # 16 prompts in the file, 32 per step: not one full batch
    checks = verdicts([*base, "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=32"])
    assert failed(checks) == ["batch"] and "only 16 training prompts" in checks["batch"].detail


def test_keys_ignored_on_this_backend_are_a_warning(base):
    check = verdicts([*base, "actor_rollout_ref.hybrid_engine=false"])["config"]
    assert check.verdict == "warn" and "actor_rollout_ref.hybrid_engine = False" in check.detail


def test_keys_without_the_key_they_need_are_listed_and_a_refused_one_fails(base):
    """Before: nothing said that these keys change nothing (and the dummy reward model alone ran the rule
    scorers instead)."""
    check = verdicts([*base, "async_training.max_staleness=3", "critic.optim.lr=1e-4"])["config"]
    assert check.verdict == "warn" and check.data["unused"] == [
        "critic.optim.lr = 0.0001 has no effect without a critic (critic.enable=true, or "
        "algorithm.adv_estimator=gae)",
        "async_training.max_staleness = 3 has no effect without async_training.mode=fully_async (one_step_off "
        "is always one step behind, sync never)",
    ]
    assert "set but without effect: critic.optim.lr = 0.0001 has no effect without a critic" in check.detail
    checks = verdicts([*base, "reward_model.dummy=true"])
    assert checks["config"].verdict == "fail" and checks["config"].detail.startswith(
        "reward_model.dummy=true has no effect without reward_model.enable=true"
    )


def test_the_models_line_of_the_support_matrix_fails_a_path_that_refuses_it(base, tmp_path):
    """A Gemma 3 model (sliding windows) asked for sequence parallelism: the support check prints every path's
    verdict on it and fails naming the key; Llama's line takes the same key."""
    gemma = make_tiny_model(tmp_path / "gemma", family="gemma3_text")
    asked = [
        "trainer.backend=ray",
        "trainer.n_workers=2",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
    ]
    support = verdicts([*base, f"actor_rollout_ref.model.path={gemma}", *asked])["support"]
    assert support.verdict == "fail" and support.detail.startswith("gemma3_text: hf rollout")
    assert (
        "prefix-tree packing (share_prompt_prefix): exact (each sliding layer under its own window)"
        in support.detail
    )
    assert support.fix.startswith(
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2: sliding-window attention"
    )
    assert verdicts([*base, *asked])["support"].verdict == "ok"


def test_missing_file_fails_the_paths_check(base, tmp_path):
    checks = verdicts([*base, f"data.val_files={tmp_path / 'nope.parquet'}"])
    assert failed(checks) == ["paths"]
    assert f"data.val_files: {tmp_path / 'nope.parquet'}" in checks["paths"].detail


def test_model_folder_without_weights_fails_the_model_check(base, tiny_model_path, tmp_path):
    broken = tmp_path / "no_weights"
    shutil.copytree(tiny_model_path, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    checks = verdicts([*base, f"actor_rollout_ref.model.path={broken}"])
    assert checks["model"].verdict == "fail" and "no weights" in checks["model"].detail


def test_raising_reward_fails_and_an_always_zero_reward_warns(base, tmp_path):
    (tmp_path / "bad.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return int(solution_str)\n"
    )
    checks = verdicts([*base, f"custom_reward_function.path={tmp_path / 'bad.py'}"])
    assert failed(checks) == ["reward"]
    assert "raised on a right-answer response for data_source 'arithmetic'" in checks["reward"].detail
    assert "ValueError: invalid literal for int() with base 10: '" in checks["reward"].detail
    (tmp_path / "zero.py").write_text("def compute_score(*args, **kwargs):\n    return 0.0\n")
    checks = verdicts([*base, f"custom_reward_function.path={tmp_path / 'zero.py'}"])
    assert checks["reward"].verdict == "warn" and checks["reward"].detail.endswith(
        " 0, wrong 'I do not know.' 0: 0 for the right answer too"
    )


def test_the_reward_probe_is_a_right_answer_in_the_tasks_own_form(base, tmp_path):
    """Before: the demo's data printed ``arithmetic: ground-truth 0.5``, which reads as a broken reward: the
    probe was a bare ``=<sum>``, not the ``A+B=<sum>`` the prompt asks for. Each built-in scorer now builds
    its task's reply from the row; where no form is known the line says why less than 1 is expected."""
    prompt = [{"role": "user", "content": "Compute it."}]
    rows = [
        ("arithmetic", "60", {"a": 47, "b": 13}),
        ("countdown", {"target": 10, "numbers": [2, 5]}, {"solution": "2 * 5"}),
        ("gsm8k", "72", {}),
        ("lighteval/MATH", "\\frac{1}{2}", {}),
        ("math", "\\frac{1}{2}", {}),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        "".join(
            json.dumps({"data_source": source, "prompt": prompt, "extra_info": info,
                        "reward_model": {"ground_truth": truth}}) + "\n"
            for source, truth, info in rows
        )
    )  # fmt: skip
    detail = verdicts([*base, f"data.train_files={path}", "data.train_batch_size=2"])["reward"].detail
    assert detail == (
        "the built-in rule scorers (by data_source): arithmetic: right answer '47+13=60' 1, wrong 'I do not "
        "know.' 0; countdown: right answer '<answer>2 * 5</answer>' 1, wrong 'I do not know.' 0; gsm8k: right "
        "answer '#### 72' 1, wrong 'I do not know.' 0; lighteval/MATH: right answer '\\\\boxed{\\\\frac{1}{2}}' 1, "
        "wrong 'I do not know.' 0; math: right answer 'Answer: \\\\frac{1}{2}' 1, wrong 'I do not know.' -1"
    )
    path.write_text(
        json.dumps({"data_source": "arithmetic", "prompt": prompt, "reward_model": {"ground_truth": "60"}})
        + "\n"
    )
    detail = verdicts([*base, f"data.train_files={path}", "data.train_batch_size=1",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=1"])["reward"].detail  # fmt: skip
    assert detail.endswith(
        "arithmetic: ground truth in 5 generic forms (no reply in this task's own form is known here: less "
        "than full marks is expected), best 0.5, wrong 'I do not know.' 0"
    )


def test_overlong_dataset_fails_the_dataset_check(base):
    checks = verdicts([*base, "data.max_prompt_length=16", "data.filter_overlong_prompts=false"])
    assert failed(checks) == ["dataset"]
    assert "16 prompts are too long and truncation is 'error'" in checks["dataset"].detail
    assert "raise data.max_prompt_length to" in checks["dataset"].fix
    checks = verdicts([*base, "data.max_prompt_length=16"])  # filtering on: nothing left
    assert checks["dataset"].verdict == "fail" and "would be dropped" in checks["dataset"].detail
    checks = verdicts(
        [*base, "data.max_prompt_length=16", "data.filter_overlong_prompts=false", "data.truncation=left"]
    )  # kept, but cut: a warning
    assert (
        checks["dataset"].verdict == "warn"
        and "16 of 16 (100%) would be truncated (left)" in checks["dataset"].detail
    )


def test_model_too_large_for_the_stated_memory_fails_naming_the_knob(base):
    checks = verdicts(base, memory_gb=0.001)
    assert failed(checks) == ["memory"]
    assert "will not fit" in checks["memory"].detail and "vs 0.0 GB (--memory-gb)" in checks["memory"].detail
    assert "actor_rollout_ref" in checks["memory"].fix


def test_config_error_fails_and_skips_what_needs_it(base):
    checks = verdicts([*base, "actor_rollout_ref.actor.optim.learning_rate=1e-5"])
    assert [c.verdict for c in checks.values()] == ["fail"] + ["skip"] * 7 + ["ok"]
    assert "did you mean 'actor_rollout_ref.actor.optim.lr'" in checks["config"].detail


def small_shape(params: int) -> ModelShape:
    """A 2-layer, 64-wide model shape with ``params`` parameters, for estimates checked by hand."""
    return ModelShape(
        params=params,
        vocab_size=1000,
        hidden_size=64,
        num_layers=2,
        intermediate_size=128,
        kv_dim=32,
        linear_in_out=100_000,
    )


@pytest.mark.filterwarnings("ignore::hybridflow.config.checks.IgnoredKeyWarning")  # lora, fsdp2 (not yet)
def test_memory_estimate_by_hand():
    shape = small_shape(10_000_000)
    cfg = load_config(
        [
            "data.train_files=x.parquet",
            "data.max_prompt_length=24",
            "data.max_response_length=8",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        ]
    )
    est = estimate_memory(cfg, shape, world_size=1)  # fp32 on CPU, no reference model, no critic
    assert est.static == {"actor weights": 40e6, "actor grads": 40e6, "AdamW state": 80e6}
    update = 2 * 9 * 1000 * 4 * 3 + 2 * 32 * 2 * (14 * 64 + 4 * 128) * 4  # logits x3 + activations
    assert est.passes["policy update"] == update
    # all 8 sequences' cache and logits, without the 40 MB of gradients (freed after each update)
    assert est.passes["generation"] == 2 * 2 * 32 * 4 * 8 * 32 + 8 * 1000 * 4 - 40e6
    assert est.device == 160e6 + update + RUNTIME_BYTES
    # with the data read, its longest prompt (10 tokens) sets the length, not data.max_prompt_length
    short = estimate_memory(cfg, shape, world_size=1, prompt_tokens=10)
    assert short.passes["policy update"] == 2 * 9 * 1000 * 4 * 3 + 2 * 18 * 2 * (14 * 64 + 4 * 128) * 4
    lora = estimate_memory(
        load_config(
            [
                "data.train_files=x.parquet",
                "algorithm.adv_estimator=grpo",
                "actor_rollout_ref.model.lora_rank=8",
            ]
        ),
        shape,
        world_size=1,
    )
    assert lora.static == {
        "actor weights": 40e6,
        "actor grads": 8 * 100_000 * 4,
        "AdamW state": 2 * 8 * 100_000 * 4,
    }
    fsdp = estimate_memory(
        load_config(
            [
                "data.train_files=x.parquet",
                "algorithm.adv_estimator=grpo",
                "actor_rollout_ref.actor.strategy=fsdp2",
                "actor_rollout_ref.actor.use_kl_loss=true",
            ]
        ),
        shape,
        world_size=4,
    )
    assert fsdp.static == {
        "actor weights": 10e6,
        "actor grads": 10e6,
        "AdamW state": 20e6,
        "reference weights": 10e6,
    }
    # generation gathers the other 3 ranks' shards (30 MB) where the freed gradients were (10 MB); rank 0 reads
    # the whole checkpoint (40 MB) before the gradients and moments (30 MB) exist
    kv = 2 * 2 * 32 * 4 * 2 * 576 + 2 * 1000 * 4  # 8 prompts x 1 over 4 ranks, 512 + 64 tokens
    assert fsdp.passes["generation"] == kv + 30e6 - 10e6
    assert fsdp.passes["checkpoint read by rank 0"] == 40e6 - 30e6
    fsdp_cfg = load_config(
        [
            "data.train_files=x.parquet",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.rollout.sharded_generation=true",
        ]
    )
    assert estimate_memory(fsdp_cfg, shape, world_size=4).passes["generation"] == kv - 10e6
    assert est.device < GB


def test_memory_knob_names_sharded_generation_when_the_gathered_model_does_not_fit():
    shape = small_shape(1_000_000_000)
    overrides = [
        "data.train_files=x.parquet",
        "algorithm.adv_estimator=grpo",
        "trainer.device=cpu",
        "actor_rollout_ref.actor.strategy=fsdp2",
    ]
    cfg = load_config(overrides)
    est = estimate_memory(cfg, shape, world_size=8)  # generation gathers 7/8 of 4 GB: the largest part
    assert est.largest_pass == "generation" and est.passes["generation"] > sum(est.static.values())
    assert "actor_rollout_ref.rollout.sharded_generation=true" in knob(cfg, est, workers_per_machine=1)
    sharded = load_config([*overrides, "actor_rollout_ref.rollout.sharded_generation=true"])
    low = estimate_memory(sharded, shape, world_size=8)
    # the KV cache alone is left; rank 0's read of the 4 GB checkpoint (before 2 GB of state) is now the peak
    assert low.passes["generation"] == est.passes["generation"] - 3.5e9
    assert low.largest_pass == "checkpoint read by rank 0"
    assert low.device == est.device - est.passes["generation"] + 2.5e9
    # a checkpoint rank 0 sends tensor by tensor is never held whole: only the KV cache is left
    streamed = estimate_memory(sharded, dataclasses.replace(shape, streams_checkpoint=True), world_size=8)
    assert streamed.passes.keys() == {"policy update", "log-prob pass", "generation"}


def test_environment_fails_when_the_rollout_engine_does_not_import(tmp_path, monkeypatch):
    from hybridflow.commands.doctor import _import_error, check_environment

    (tmp_path / "broken_engine.py").write_text("raise RuntimeError('no CUDA driver found')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))  # find_spec in this process sees it too
    assert _import_error("broken_engine") == "RuntimeError: no CUDA driver found"
    assert _import_error("json") == "" and _import_error("no_such_engine_xyz") == "not installed"
    cfg = load_unvalidated(["data.train_files=x.parquet", "actor_rollout_ref.rollout.name=vllm"])
    monkeypatch.setattr("hybridflow.commands.doctor._import_error", lambda module: f"{module}: not installed")
    check = check_environment(cfg)
    assert check.verdict == "fail" and "rollout.name is vllm but it does not import: vllm" in check.detail


SCORERS = {
    "tensor.py": "import torch\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return torch.tensor(float(str(ground_truth) in solution_str))\n",
    "numpy.py": "import numpy as np\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return {'score': np.float32(str(ground_truth) in solution_str)}\n",
    "text.py": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return '1.0'\n",
}


@pytest.mark.parametrize("scorer", sorted(SCORERS))
def test_doctor_accepts_exactly_the_scores_training_accepts(base, tmp_path, tiny_model_path, scorer):
    """Before: doctor failed a 0-d tensor and a numpy float that training takes, with its own rule. Now both
    call ``checked_score``: what RewardManager accepts passes doctor, what it refuses fails doctor."""
    path = tmp_path / scorer
    path.write_text(SCORERS[scorer])
    checks = verdicts([*base, f"custom_reward_function.path={path}"])
    manager = RewardManager(AutoTokenizer.from_pretrained(tiny_model_path), load_custom_reward_function(path))
    try:
        manager._score_one(0, "arithmetic", "=5", 5, {})
        trains = True
    except UserError:
        trains = False
    assert trains == (scorer != "text.py")
    if trains:
        assert checks["reward"].verdict == "ok", checks["reward"].detail
        assert "' 1, wrong 'I do not know.' 0" in checks["reward"].detail
    else:
        assert failed(checks) == ["reward"]
        assert "on a right-answer response for data_source 'arithmetic'" in checks["reward"].detail
        assert "it returned str '1.0': a score is a number" in checks["reward"].detail


def test_replay_buffer_mistakes_are_config_problems(base, capsys):
    """Before: doctor said nothing (the replay buffer checks its settings when the trainer builds it), and
    ``hybridflow train`` stopped there with a ValueError traceback."""
    bad = [*base, "replay_buffer.enable=true", "replay_buffer.strategy=prioritized"]
    checks = verdicts(bad)
    assert failed(checks) == ["config"]
    assert checks["config"].detail == (
        "replay_buffer: schedule phase 0: unknown strategy 'prioritized'; known: ['uniform', 'priority']"
    )
    assert cli(["train", *bad]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hybridflow train: error: replay_buffer: schedule phase 0: unknown strategy 'prioritized'; known: "
        "['uniform', 'priority']"
    )


def test_dataset_check_counts_prompt_tokens_as_the_dataset_feeds_them(base, data_dir, tiny_model_path):
    """Before: doctor always chat-templated the prompts it measured, also under data.apply_chat_template=false."""
    from hybridflow.data.dataset import read_rows

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = read_rows(data_dir / "train.parquet")
    raw = max(len(tok("\n".join(m["content"] for m in row["prompt"]))["input_ids"]) for row in rows)
    texts = [
        tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
        for row in rows
    ]
    templated = max(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"])
    assert raw < templated
    assert (
        f", max {raw} vs data.max_prompt_length"
        in verdicts([*base, "data.apply_chat_template=false"])["dataset"].detail
    )
    assert f", max {templated} vs data.max_prompt_length" in verdicts(base)["dataset"].detail


def test_memory_estimate_splits_a_long_sequence_and_names_sequence_parallelism():
    shape = small_shape(1_000_000)
    overrides = [
        "data.train_files=x.parquet",
        "algorithm.adv_estimator=grpo",
        "data.max_prompt_length=8000",
        "data.max_response_length=192",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "trainer.backend=ray",
        "trainer.n_workers=4",
    ]
    one = load_config(overrides)
    four = load_config([*overrides, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4"])
    whole = estimate_memory(one, shape, world_size=4)
    split = estimate_memory(four, shape, world_size=4)
    update = 193 * 1000 * 4 * 3 + 8192 * 2 * (14 * 64 + 4 * 128) * 4  # logits x3 + activations, one sequence
    assert whole.passes["policy update"] == update and whole.largest_pass == "policy update"
    assert split.passes["policy update"] == update / 4  # each of 4 ranks holds a quarter of its tokens
    assert "largest pass (policy update, each sequence over 4 ranks)" in split.summary()
    for cfg in (one, four):
        cfg.trainer.device = (
            "cuda"  # each worker a GPU of its own: splitting a sequence lowers each one's peak
        )
    hint = "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 (one sequence's activations split over 2 GPUs of the 4; now 1)"
    assert knob(one, whole, workers_per_machine=1).startswith(hint)
    assert (
        "ulysses_sequence_parallel_size=8 (one sequence's activations split over 8 GPUs (with trainer.n_workers a multiple of 8); now 4)"
        in knob(four, split, 1)
    )
