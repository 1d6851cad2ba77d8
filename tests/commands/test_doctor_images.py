"""``hybridflow doctor`` on a vision-language model and image rows: image tokens counted in the prompt
lengths and reported (p50/p90/max), the vision tower counted in the parameters."""

import json

from hybridflow.commands.cli import main as cli
from hybridflow.data.prepare import main as prepare_data


def test_doctor_reports_image_tokens_of_a_vlm_dataset(tiny_vlm, tmp_path, capsys):
    prepare_data(["shapes", str(tmp_path), "--train-size", "12", "--test-size", "2", "--image-size", "112"])
    capsys.readouterr()
    base = [
        f"data.train_files={tmp_path / 'train.parquet'}",
        f"actor_rollout_ref.model.path={tiny_vlm('qwen2_vl')}",
        "algorithm.adv_estimator=grpo",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    assert cli(["doctor", "--json", *base, "data.max_prompt_length=256"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    dataset = checks["dataset"]
    assert dataset["data"]["image_tokens"] == {
        "p50": 16,
        "p90": 16,
        "max": 16,
    }  # 112 px: 8x8 patches, 2x2 merged
    assert "image tokens p50 16, p90 16, max 16" in dataset["detail"]
    assert checks["model"]["verdict"] == "ok" and "qwen2_vl" in checks["model"]["detail"]
    # the image tokens are in the prompt length: a limit one token short drops every prompt
    longest = dataset["data"]["max"]
    assert cli(["doctor", "--json", *base, f"data.max_prompt_length={longest - 1}"]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert "every prompt is longer than the limit" in checks["dataset"]["detail"]
    assert longest - 16 > 0 and cli(["doctor", *base, f"data.max_prompt_length={longest}"]) == 0
