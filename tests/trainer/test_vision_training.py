"""RL on tiny vision-language models end to end: GRPO with a reference, PPO with a critic, LoRA, a frozen
vision tower, and FSDP2 on 2 Ray workers; checkpoints that plain transformers load with their processor, and
``hybridflow generate --image`` on them."""

import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor

from hybridflow.commands.cli import main as cli
from hybridflow.data.prepare import main as prepare_data
from hybridflow.trainer import PPOTrainer, load_config

# a random model never names a colour: a reward that varies with the text, so every run's update moves weights
VARYING_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 7 / 7
"""


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes")
    prepare_data(["shapes", str(out), "--train-size", "16", "--test-size", "4"])
    (out / "reward.py").write_text(VARYING_REWARD)
    return out


def run(shapes_dir: Path, model: str, run_dir: Path, *overrides: str, steps: int = 2) -> list[dict]:
    config = load_config(
        [
            f"data.train_files={shapes_dir / 'train.parquet'}",
            f"data.val_files={shapes_dir / 'test.parquet'}",
            f"actor_rollout_ref.model.path={model}",
            f"trainer.default_local_dir={run_dir}",
            "data.max_prompt_length=64",
            "data.max_response_length=4",
            "data.train_batch_size=4",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "critic.ppo_micro_batch_size_per_gpu=4",
            f"trainer.total_training_steps={steps}",
            "trainer.logger=[file]",
            f"custom_reward_function.path={shapes_dir / 'reward.py'}",
            *overrides,
        ]
    )
    with PPOTrainer(config) as trainer:  # closed: a Ray run gives its CPUs back for the next test
        trainer.fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "timing_s/step" in row]
    assert [row["step"] for row in logged] == list(range(1, steps + 1))
    for row in logged:
        assert row["rollout/logprob_diff"] < 1e-4
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
    return logged


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """The parameters by module name (the files keep the hub's own key layouts, which differ per family)."""
    return dict(AutoModelForImageTextToText.from_pretrained(folder).named_parameters())


def test_grpo_with_a_reference_saves_a_vlm_that_transformers_and_generate_load(
    shapes_dir, tiny_vlm, tmp_path, capsys
):
    folder = tiny_vlm("qwen2_vl")
    steps = run(
        shapes_dir,
        folder,
        tmp_path,
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.log_val_generations=2",
    )
    assert all("actor/kl_loss" in row for row in steps)
    # the report shows each validation sample's picture beside its prompt
    assert cli(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert page.count("<img src='data:image/png;base64,") == 2 and "What colour is the shape?" in page
    capsys.readouterr()
    saved = tmp_path / "global_step_2" / "actor" / "huggingface"
    model = AutoModelForImageTextToText.from_pretrained(saved)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert type(AutoImageProcessor.from_pretrained(saved)).__name__ == "Qwen2VLImageProcessorPil"
    assert (saved / "processor_config.json").read_text() == (
        Path(folder) / "processor_config.json"
    ).read_text()
    picture = tmp_path / "red.png"
    Image.new("RGB", (56, 56), (220, 30, 30)).save(picture)
    argv = ["generate", "--model", str(tmp_path), "--image", str(picture), "--prompt", "What colour?"]
    assert cli([*argv, "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith(">>> What colour?\n")
    assert (
        cli(["generate", "--model", str(tmp_path), "--image", str(tmp_path / "no.png"), "--prompt", "x"]) == 2
    )
    assert "image file not found" in capsys.readouterr().err


def test_ppo_with_a_critic_on_llava_and_its_processor_round_trip(shapes_dir, tiny_vlm, tmp_path):
    steps = run(shapes_dir, tiny_vlm("llava"), tmp_path, "algorithm.adv_estimator=gae")
    assert all(math.isfinite(row["critic/vf_loss"]) for row in steps)
    saved = tmp_path / "global_step_2" / "actor" / "huggingface"
    assert type(AutoProcessor.from_pretrained(saved)).__name__ == "LlavaProcessor"


def test_a_frozen_vision_tower_stays_while_the_projector_and_language_model_train(
    shapes_dir, tiny_vlm, tmp_path
):
    folder = Path(tiny_vlm("qwen3_vl"))
    run(shapes_dir, str(folder), tmp_path, "actor_rollout_ref.actor.freeze_vision_tower=true")
    before, after = weights(folder), weights(tmp_path / "global_step_2" / "actor" / "huggingface")
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    tower = {
        n for n in before if n.startswith("model.visual.") and ".merger" not in n and "deepstack" not in n
    }
    assert tower and not tower & changed
    assert any(".merger." in n for n in changed) and any(
        n.startswith("model.language_model.") for n in changed
    )


def test_lora_trains_the_language_model_only(shapes_dir, tiny_vlm, tmp_path):
    folder = Path(tiny_vlm("qwen2_5_vl"))
    run(
        shapes_dir,
        str(folder),
        tmp_path,
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
    )
    before, after = weights(folder), weights(tmp_path / "global_step_2" / "actor" / "huggingface")
    assert before.keys() == after.keys()  # the merged checkpoint is a plain model again
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(n.startswith("model.language_model.") for n in changed)


def test_fsdp2_on_two_ray_workers_shards_vision_blocks_and_trains(
    shapes_dir, tiny_vlm, tmp_path, ray_session
):
    steps = run(
        shapes_dir,
        tiny_vlm("qwen2_5_vl"),
        tmp_path,
        "trainer.backend=ray",
        "trainer.n_workers=2",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        steps=1,
    )
    assert all(row["actor/grad_norm"] > 0 for row in steps)
    assert AutoModelForImageTextToText.from_pretrained(tmp_path / "global_step_1" / "actor" / "huggingface")


def test_fsdp2_blocks_of_a_vlm_include_its_vision_blocks(tiny_vlm):
    from hybridflow.workers.sharding import _decoder_layers

    for family, vision in (("qwen2_vl", 2), ("llava", 2)):
        model = AutoModelForImageTextToText.from_pretrained(tiny_vlm(family))
        blocks = _decoder_layers(model)
        assert len(blocks) == vision + model.config.get_text_config().num_hidden_layers
