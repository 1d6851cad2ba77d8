"""``scripts/gpu_check.py``, the one GPU check, on a machine without a GPU: what can be checked here (its
arguments, its time budget, its stage runner and its one JSON report); the GPU stages themselves need a GPU."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def test_stages_are_chosen_by_name_and_run_in_their_order(gpu_check, capsys):
    assert gpu_check.parse_args([]).stages == [
        "environment",
        "fsdp_single",
        "vllm",
        "rollout",
        "weight_sync",
        "async",
    ]
    assert gpu_check.parse_args(["--stages", "async,environment"]).stages == ["environment", "async"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--stages", "environment,vlm"])
    assert "unknown stage(s) ['vlm']; the stages are environment, fsdp_single" in capsys.readouterr().err


def test_the_stages_fit_ten_minutes_and_the_budget_caps_each(gpu_check):
    assert sum(stage.limit_s for stage in gpu_check.STAGES) <= 600
    assert gpu_check.stage_timeout(90, 500) == 90
    assert gpu_check.stage_timeout(90, 40) == 40  # what is left of the budget
    assert gpu_check.stage_timeout(90, 10) is None  # too little to finish: skipped


def test_a_stage_is_ok_failed_or_timed_out_with_its_output(gpu_check):
    ok = gpu_check.run_stage([sys.executable, "-c", "print('done')"], 30)
    assert ok["status"] == "ok" and ok["returncode"] == 0 and ok["tail"] == "done\n"
    failed = gpu_check.run_stage([sys.executable, "-c", "import sys; print('oops'); sys.exit(3)"], 30)
    assert failed["status"] == "failed" and failed["returncode"] == 3 and "oops" in failed["tail"]
    late = gpu_check.run_stage([sys.executable, "-c", "import time; time.sleep(60)"], 1)
    assert late["status"] == "timeout" and 1 <= late["seconds"] < 30


def test_without_a_gpu_it_writes_one_json_saying_what_was_skipped(gpu_check, tmp_path, capsys):
    out = tmp_path / "results" / "gpu_check.json"
    assert gpu_check.main(["--out", str(out)]) == 1  # nothing but the environment could be checked
    report = json.loads(out.read_text())
    assert report["cuda"] is False and report["gpus"] == 0
    stages = report["stages"]
    assert list(stages) == [stage.name for stage in gpu_check.STAGES]
    assert stages["environment"]["status"] == "ok"
    assert stages["environment"]["results"]["gpus"] == [] and stages["environment"]["results"]["torch"]
    for name in ("fsdp_single", "vllm", "rollout", "weight_sync", "async"):
        assert stages[name] == {
            "status": "skipped",
            "why": "no CUDA device (torch.cuda.is_available() is false)",
        }
    assert not out.with_name("gpu_check.json.tmp").exists()
    assert "nothing but the environment was checked" in capsys.readouterr().out


def test_the_vllm_and_weight_sync_stages_follow_what_the_machine_has(gpu_check, tmp_path):
    stages = {stage.name: stage for stage in gpu_check.STAGES}
    one = {"cuda": True, "gpus": 1, "vllm": False, "work": tmp_path}
    assert stages["vllm"].command(one) == "vllm does not import here (pip install vllm)"
    assert "weight_sync_one_gpu" in stages["weight_sync"].command(one)  # nccl needs a GPU per rank
    assert (
        "--async-backend" in (cmd := stages["async"].command(one))
        and cmd[cmd.index("--async-backend") + 1] == "local"
    )
    two = {**one, "gpus": 2, "vllm": True}
    assert "bench/weight_sync.py" in stages["weight_sync"].command(two)
    assert "tests/vllm_engine" in stages["vllm"].command(two)
    assert "trainer.placement=split" in " ".join(stages["async"].command(two))


def test_the_one_gpu_weight_sync_check_runs_its_buckets(gpu_check, tiny_model_path, tmp_path):
    """The weight-sync stage's one-GPU check, run on the CPU with the tiny model: it cuts the weights into
    buckets as the link does and reports the bytes (every tensor, the tied one under both names) and a time
    against the memcpy floor (the check fell out of step with the link's bucketing once, unseen without a GPU)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "weight_sync.json"
    assert gpu_check._weight_sync_one_gpu(str(out), device="cpu", model_path=tiny_model_path) == 0
    result = json.loads(out.read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    expected = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert result["mb"] == expected / 2**20
    assert result["bucket_and_checksum_s"] > 0 and result["vs_memcpy"] == (
        result["bucket_and_checksum_s"] / result["memcpy_s"]
    )
