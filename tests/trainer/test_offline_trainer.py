"""The offline trainers end to end on the tiny model: configs, DPO (local and 2 Ray workers, and with LoRA), KTO,
SFT (fixed-size and token-budget micro-batches)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

import hybridflow.workers.actor as actor_worker
from hybridflow.commands.cli import main as cli
from hybridflow.config.offline import (
    CONFIGS,
    DPOConfig,
    SFTConfig,
    default_config_path,
    load_offline_config,
)
from hybridflow.config.schema import ConfigError
from hybridflow.data.prepare import main as prepare_data
from hybridflow.models import make_tiny_model
from hybridflow.runs.checkpoint import find_latest_checkpoint
from hybridflow.runs.lock import RunLock
from hybridflow.runs.trained_model import load_trained_actor
from hybridflow.trainer import main_dpo, main_kto, main_sft
from hybridflow.trainer.offline import OfflineTrainer
from hybridflow.utils.errors import UserError
from hybridflow.workers.modeling import response_log_probs
from hybridflow.workers.packing import MicroBatching


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("offline")
    for fmt in ("sft", "dpo", "kto"):
        prepare_data(
            ["arithmetic", str(out / fmt), "--format", fmt, "--train-size", "16", "--test-size", "4"]
        )
    return out


def overrides(
    data: Path, kind: str, model: str, run: Path, *extra: str, val: str = "train.parquet"
) -> list[str]:
    """Validation on the training rows by default: whether the objective is learned, not generalisation."""
    return [
        f"data.train_files={data / kind / 'train.parquet'}",
        f"data.val_files={data / kind / val}",
        f"model.partial_pretrain={model}",
        f"trainer.default_local_dir={run}",
        "data.train_batch_size=4",
        "data.micro_batch_size_per_gpu=2",
        "data.max_length=128",
        "optim.lr=2e-3",
        "trainer.logger=[file]",
        "trainer.total_training_steps=4",
        *extra,
    ]


def logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_packaged_yaml_equals_the_dataclass_defaults(kind):
    path = default_config_path(CONFIGS[kind])
    assert OmegaConf.to_container(OmegaConf.load(path)) == CONFIGS[kind]().to_dict()


def test_config_uses_verl_sft_names_and_names_bad_keys(tmp_path):
    cfg = load_offline_config(
        SFTConfig,
        [
            "data.train_files=a.parquet",
            "model.partial_pretrain=~/m",
            "data.max_length=256",
            "optim.lr=1e-4",
            "trainer.total_epochs=2",
        ],
    )
    assert (cfg.data.max_length, cfg.optim.lr, cfg.trainer.total_epochs) == (256, 1e-4, 2)
    assert not cfg.model.partial_pretrain.startswith("~") and cfg.data.seed == cfg.trainer.seed
    with pytest.raises(
        ConfigError, match="unknown config key 'optim.learning_rate'.*did you mean 'optim.lr'"
    ):
        load_offline_config(SFTConfig, ["data.train_files=a", "optim.learning_rate=1"])
    with pytest.raises(ConfigError, match="dpo.loss_type: unknown preference loss 'kto'"):
        load_offline_config(DPOConfig, ["data.train_files=a", "dpo.loss_type=kto"])
    with pytest.raises(ConfigError, match="label_smoothing only applies to dpo.loss_type=sigmoid, not ipo"):
        load_offline_config(DPOConfig, ["data.train_files=a", "dpo.loss_type=ipo", "dpo.label_smoothing=0.1"])
    with pytest.raises(ConfigError, match="data.train_files is required"):
        load_offline_config(SFTConfig, [])
    with pytest.raises(ConfigError, match="data.max_token_len_per_gpu must be >= 1, got 0"):
        load_offline_config(
            SFTConfig, ["data.train_files=a", "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=0"]
        )
    with pytest.raises(ConfigError, match="model.lora_rank must be >= 0"):
        load_offline_config(DPOConfig, ["data.train_files=a", "model.lora_rank=-1"])


@pytest.mark.learning
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_dpo_starts_at_ln2_and_learns_the_preferences(data, tiny_model_path, tmp_path, backend, request):
    extra = ["trainer.backend=ray", "trainer.n_workers=2"] if backend == "ray" else []
    if backend == "ray":
        request.getfixturevalue("ray_session")
    with OfflineTrainer(
        load_offline_config(DPOConfig, overrides(data, "dpo", tiny_model_path, tmp_path, *extra))
    ) as trainer:
        trainer.fit()
    rows = logged(tmp_path)
    before, first, after = rows[0], rows[1], rows[-1]
    assert before["val/loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert before["val/rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert after["val/rewards/margins"] > 0.02 and after["val/loss"] < math.log(2) - 0.01
    assert after["val/rewards/accuracies"] >= 0.75
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "actor/grad_norm"} <= set(
        first
    )
    model, _ = load_trained_actor(tmp_path)  # the checkpoint is a plain Hugging Face model
    assert find_latest_checkpoint(tmp_path).name == "global_step_4" and model.config.model_type == "llama"


@pytest.mark.parametrize("disable_dropout", [True, False])
def test_dpo_with_a_dropout_model_starts_at_ln2_with_dropout_off(data, tmp_path, disable_dropout):
    """Before: with attention dropout 0.5 the policy's training forward was not the reference's eval forward,
    and the first DPO loss was not ln 2 although the policy equals the reference."""
    model = make_tiny_model(tmp_path / "model", attention_dropout=0.5)
    cfg = overrides(
        data,
        "dpo",
        model,
        tmp_path / "run",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        f"model.disable_dropout={disable_dropout}",
    )
    with OfflineTrainer(load_offline_config(DPOConfig, cfg)) as trainer:
        trainer.fit()
    first = logged(tmp_path / "run")[0]
    if disable_dropout:
        assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
        assert first["rewards/margins"] == pytest.approx(0, abs=1e-5)
    else:  # the key keeps the checkpoint's dropout: the training forward is then a noisy policy
        assert abs(first["train/loss"] - math.log(2)) > 1e-4  # 7.5e-4 here, 75x the tolerance above


@pytest.mark.learning
def test_kto_cli_run_starts_at_one_half_and_separates_good_from_bad(data, tiny_model_path, tmp_path):
    # 8 steps: 4 lowered the loss by only 0.003; 8 by 0.02-0.03 with each of 4 model and data seeds
    args = overrides(
        data, "kto", tiny_model_path, tmp_path, "kto.undesirable_weight=2", "trainer.total_training_steps=8"
    )
    assert cli(["kto", *args]) == 0
    rows = logged(tmp_path)
    # policy = reference: z0 = 0 and every row costs its weight x (1 - sigmoid(0)); half the rows weigh 2
    assert rows[0]["val/loss"] == pytest.approx(0.5 * (1 + 2) / 2, abs=1e-5)
    assert rows[-1]["val/rewards/chosen"] > rows[-1]["val/rewards/rejected"] + 0.01
    assert rows[-1]["val/loss"] < rows[0]["val/loss"] - 0.01


@pytest.mark.learning
def test_sft_lowers_the_validation_loss_and_cli_names_config_errors(data, tiny_model_path, tmp_path, capsys):
    assert cli(["sft", *overrides(data, "sft", tiny_model_path, tmp_path, val="test.parquet")]) == 0
    rows = logged(tmp_path)
    assert rows[-1]["val/loss"] < rows[0]["val/loss"] - 0.5
    assert cli(["sft", "data.train_files=x", "data.max_lenght=3"]) == 2
    assert "did you mean 'data.max_length'" in capsys.readouterr().err


@pytest.mark.parametrize("module", [main_sft, main_dpo, main_kto])
def test_the_module_entry_points_print_an_input_error_as_one_line(
    module, data, tiny_model_path, tmp_path, capsys
):
    """Before: ``python -m hybridflow.trainer.main_sft`` caught only config errors, its own way, so a missing
    data file (or model) ended in a traceback; it now goes through ``run_cli`` as ``main_ppo`` does."""
    kind = module.__name__.rpartition("_")[2]
    args = overrides(data, kind, tiny_model_path, tmp_path, f"data.train_files={tmp_path / 'gone.parquet'}")
    assert module.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"hybridflow {kind}: error: ") and "gone.parquet" in err
    with pytest.raises(UserError, match="gone.parquet"):
        module.main(["--debug", *args])


def test_sft_resumes_from_its_last_checkpoint(data, tiny_model_path, tmp_path):
    with OfflineTrainer(
        load_offline_config(
            SFTConfig, overrides(data, "sft", tiny_model_path, tmp_path, "trainer.total_training_steps=2")
        )
    ) as trainer:
        trainer.fit()
    resumed = OfflineTrainer(
        load_offline_config(SFTConfig, overrides(data, "sft", tiny_model_path, tmp_path))
    )
    resumed.init_workers()
    resumed.load_checkpoint()
    assert (resumed.global_step, resumed.train_loader.position) == (2, 2)
    resumed.close()


@pytest.mark.learning
def test_dpo_with_lora_takes_the_reference_from_the_adapter_off(data, tiny_model_path, tmp_path, monkeypatch):
    loaded = []  # every model the workers build (the real loader, counted)
    load_model = actor_worker.load_model
    monkeypatch.setattr(
        actor_worker, "load_model", lambda *a, **k: loaded.append(a[0]) or load_model(*a, **k)
    )
    config = load_offline_config(
        DPOConfig,
        overrides(
            data,
            "dpo",
            tiny_model_path,
            tmp_path,
            "model.lora_rank=4",
            "model.lora_alpha=8",
            "optim.lr=1e-2",
            "trainer.total_training_steps=2",
        ),
    )
    with OfflineTrainer(config) as trainer:
        trainer.fit()
        assert (
            loaded == [tiny_model_path] and trainer.wg.ref is trainer.wg.actor_rollout
        )  # one model, no copy
        batch = next(iter(trainer.val_loader))
        ref = trainer.wg.ref.compute_ref_log_prob(batch).batch["ref_log_prob"]
        policy = trainer.wg.actor_rollout.compute_log_prob(batch).batch["old_log_probs"]
    base, _ = response_log_probs(AutoModelForCausalLM.from_pretrained(tiny_model_path).eval(), batch)
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(ref[mask], base[mask], rtol=1e-5, atol=1e-5)  # adapter off = the base model
    assert (policy - ref)[mask].abs().max() > 1e-3  # while the trained adapter did move the policy
    rows = logged(tmp_path)
    assert rows[0]["val/loss"] == pytest.approx(
        math.log(2), abs=1e-5
    )  # LoRA's B starts at 0: policy = reference
    assert rows[1]["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[-1]["val/rewards/margins"] > 0


def test_sft_token_budget_micro_batches_give_the_fixed_size_update(
    data, tiny_model_path, tmp_path, monkeypatch
):
    cuts = []  # rows of each micro-batch the update ran (the real split, recorded)
    split = MicroBatching.split
    monkeypatch.setattr(
        MicroBatching,
        "split",
        lambda self, d, count=0: (
            cuts.append([len(m) for m, _ in split(self, d, count)]) or split(self, d, count)
        ),
    )

    def one_step(*extra: str) -> tuple[dict, dict, float, object]:
        """Weights before and after one SFT step, its gradient norm (before clipping), the batch."""
        config = load_offline_config(SFTConfig, overrides(data, "sft", tiny_model_path, tmp_path, *extra))
        with OfflineTrainer(config) as trainer:
            trainer.init_workers()
            start = {
                k: v.copy() for k, v in trainer.wg.actor_rollout.get_weights()[0].items()
            }  # local: views
            batch = next(iter(trainer.train_loader))
            metrics: dict[str, float] = {}
            trainer.train_step(batch, metrics)
            norm = metrics["actor/grad_norm"]
            return start, trainer.wg.actor_rollout.get_weights()[0], norm, batch

    start, fixed, fixed_norm, batch = one_step()
    longest = int(batch.batch["attention_mask"].sum(-1).max())  # a budget of one row: 4 micro-batches, not 2
    _, budget, budget_norm, _ = one_step("data.use_dynamic_bsz=true", f"data.max_token_len_per_gpu={longest}")
    assert cuts == [[2, 2], [1, 1, 1, 1]]
    assert budget_norm == pytest.approx(fixed_norm, rel=1e-5)  # the same gradient
    assert max(float(np.abs(fixed[k] - start[k]).max()) for k in start) > 1e-4  # the step moved the weights
    # AdamW's first step moves each weight by lr * g / (|g| + 1e-8): rounding in a gradient entry near 1e-8
    # shows as a fraction of lr (2e-3), a wrongly weighted micro-batch as sign flips of 2 lr
    for name, value in fixed.items():
        np.testing.assert_allclose(budget[name], value, rtol=1e-5, atol=2e-5, err_msg=name)


def test_offline_runs_go_through_the_run_loop_lock_resume_check_hooks_and_console_line(
    data, tiny_model_path, tmp_path, capsys
):
    """What RL runs do, a DPO run does too: it holds the run folder, refuses a resume with other data settings,
    calls hooks, and its console line shows the loss, margin, accuracy, gradient norm and lr."""
    run = tmp_path / "run"
    args = overrides(
        data, "dpo", tiny_model_path, run, "trainer.total_training_steps=2", "trainer.logger=[console,file]"
    )
    seen = []
    with OfflineTrainer(load_offline_config(DPOConfig, args)) as trainer:
        trainer.register_hook(
            "on_step_end", lambda t, step, metrics, batch: seen.append((step, "train/loss" in metrics))
        )
        trainer.register_hook("on_checkpoint", lambda t, step, metrics, batch: seen.append((step, "saved")))
        with RunLock(run):  # another process owns the folder: the run must not start
            with pytest.raises(UserError, match="in use by another run"):
                trainer.fit()
        trainer.fit()
    assert seen == [(1, True), (2, True), (2, "saved")]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step 2 |")]
    assert len(lines) == 1
    for label in ("loss", "margin", "acc", "grad_norm", "lr"):
        assert f"| {label} " in lines[0], lines[0]
    first_loss = logged(run)[1]["train/loss"]
    assert first_loss == pytest.approx(math.log(2), abs=0.05)  # the policy starts as the reference

    bigger_batches = [*args, "data.train_batch_size=8", "trainer.total_training_steps=3"]
    with OfflineTrainer(load_offline_config(DPOConfig, bigger_batches)) as trainer:
        with pytest.raises(UserError, match=r"other data settings \(data.train_batch_size 4 -> 8"):
            trainer.fit()
