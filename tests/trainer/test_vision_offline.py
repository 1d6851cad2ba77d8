"""SFT and DPO on image rows (TRL's vision formats: an images column beside prompt/response or
prompt/chosen/rejected), on a tiny vision-language model: the images reach the policy and the reference."""

import json
import math
from pathlib import Path

import pytest
import torch

from hybridflow.config.offline import DPOConfig, SFTConfig, load_offline_config
from hybridflow.data.offline import PreferenceDataset, SFTConversationDataset
from hybridflow.data.prepare import main as prepare_data
from hybridflow.trainer.offline import OfflineTrainer
from hybridflow.workers.modeling import load_image_prompts, load_model, load_tokenizer, response_log_probs


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vision_offline")
    for fmt in ("sft", "dpo"):
        prepare_data(["shapes", str(out / fmt), "--format", fmt, "--train-size", "16", "--test-size", "4"])
    return out


def fit(config_cls, data: Path, kind: str, model: str, run: Path, *extra: str) -> list[dict]:
    overrides = [
        f"data.train_files={data / kind / 'train.parquet'}",
        f"data.val_files={data / kind / 'train.parquet'}",
        f"model.partial_pretrain={model}",
        f"trainer.default_local_dir={run}",
        "data.train_batch_size=4",
        "data.micro_batch_size_per_gpu=2",
        "data.max_length=96",
        "optim.lr=5e-3",
        "trainer.logger=[file]",
        "trainer.total_training_steps=4",
        *extra,
    ]
    with OfflineTrainer(load_offline_config(config_cls, overrides)) as trainer:
        trainer.fit()
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.learning
def test_sft_on_image_rows_lowers_the_loss_and_the_pictures_matter(data, tiny_vlm, tmp_path):
    folder = tiny_vlm("qwen2_vl")
    rows = fit(SFTConfig, data, "sft", folder, tmp_path)
    assert rows[-1]["val/loss"] < rows[0]["val/loss"] - 0.5
    tokenizer = load_tokenizer(folder)
    dataset = SFTConversationDataset(
        data / "sft" / "train.parquet", tokenizer, 96, processor=load_image_prompts(folder, tokenizer)
    )
    batch = dataset.collate([dataset[0], dataset[1]])
    assert [len(images) for images in batch.non_tensor_batch["image_inputs"]] == [1, 1]
    model = load_model(folder, torch.device("cpu")).eval()
    with torch.no_grad():
        seen = response_log_probs(model, batch)[0]
        batch.non_tensor_batch["image_inputs"] = batch.non_tensor_batch["image_inputs"][::-1]  # swap pictures
        swapped = response_log_probs(model, batch)[0]
    assert not torch.allclose(seen, swapped, atol=1e-4)


@pytest.mark.learning
def test_dpo_on_image_rows_starts_at_ln2_with_the_reference_seeing_the_images(data, tiny_vlm, tmp_path):
    rows = fit(
        DPOConfig, data, "dpo", tiny_vlm("llava"), tmp_path, "optim.lr=1e-3", "trainer.total_training_steps=8"
    )
    assert rows[0]["val/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[1]["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[-1]["val/loss"] < math.log(2) - 0.005  # measured 0.672 after 8 steps


def test_a_preference_row_with_an_image_in_the_completion_is_refused(data, tiny_vlm, tmp_path):
    folder = tiny_vlm("llava")
    tokenizer = load_tokenizer(folder)
    bad = {
        "prompt": "<image>Colour?",
        "chosen": "red <image>",
        "rejected": "blue",
        "images": [{"bytes": b"x"}],
    }
    (tmp_path / "bad.jsonl").write_text(json.dumps({**bad, "images": []}) + "\n")
    with pytest.raises(
        ValueError, match=r"bad.jsonl: row 0: .*1 <image> placeholder\(s\) for the 'images' column"
    ):
        PreferenceDataset(
            tmp_path / "bad.jsonl", tokenizer, 96, processor=load_image_prompts(folder, tokenizer)
        )
