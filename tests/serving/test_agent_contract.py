"""What a served agent is given and what becomes of what it does: its ``sample`` is the data row exactly as
the file holds it (plus ``messages``); its return value is scored by the one rule for scores; an agent that
raises stops ``hybridflow train`` with one line, or with ``on_error=score_zero`` scores that session 0."""

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.commands.cli import main as cli
from hybridflow.config.schema import RolloutConfig
from hybridflow.data import PromptLoader, RLHFDataset
from hybridflow.data.dataset import read_rows
from hybridflow.serving import ServedRollout
from hybridflow.utils.errors import InputError
from hybridflow.workers.rollout import HFRollout

ECHO_ROW = """
async def run(client, sample):
    await client.chat.completions.create(model="policy", messages=sample["messages"], max_tokens=2)
    truth = sample["reward_model"]["ground_truth"]  # the row's nesting, as a verl-format file holds it
    return {"score": float(len(truth) > 0), "sample": sample}
"""
FAILS_ON_ODD = """
async def run(client, sample):
    await client.chat.completions.create(model="policy", messages=sample["messages"], max_tokens=2)
    if sample["extra_info"]["index"] % 2:
        raise RuntimeError("odd row")
    return True  # a bool is a score, as for every reward function (the one rule)
"""


def _rollout(model_path: str, tmp_path: Path, agent: str, **served) -> tuple[ServedRollout, AutoTokenizer]:
    (tmp_path / "agent.py").write_text(agent)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = RolloutConfig(n=2)
    config.served_agent.path = str(tmp_path / "agent.py")
    for key, value in served.items():
        setattr(config.served_agent, key, value)
    engine = HFRollout(AutoModelForCausalLM.from_pretrained(model_path), tokenizer, config, 8)
    return ServedRollout(engine, tokenizer, config, 8), tokenizer


def _batch(data_dir: Path, tokenizer, size: int = 4):
    dataset = RLHFDataset(data_dir / "train.parquet", tokenizer, max_prompt_length=64)
    batch = next(iter(PromptLoader(dataset, size, shuffle=False)))
    batch.meta_info["n"] = 2
    return batch


def test_the_sample_is_the_row_as_the_file_holds_it(tiny_model_path, data_dir, tmp_path):
    rollout, tokenizer = _rollout(tiny_model_path, tmp_path, ECHO_ROW)
    try:
        out = rollout.generate_sequences(_batch(data_dir, tokenizer))
    finally:
        rollout.close()
    file_rows = read_rows(data_dir / "train.parquet")[:4]
    samples = list(out.non_tensor_batch["reward_extra/sample"])
    assert len(samples) == 8  # 4 prompts x 2 sessions, one call each
    for i, sample in enumerate(samples):
        row = file_rows[i // 2]
        assert {k: v for k, v in sample.items() if k != "messages"} == row  # every column, nested as written
        assert sample["messages"] == row["prompt"]
    assert out.batch["rm_scores"].sum(-1).tolist() == [1.0] * 8
    assert samples[0] is not samples[1]  # each session its own copy


def test_score_zero_counts_the_sessions_whose_agent_raised(tiny_model_path, data_dir, tmp_path):
    rollout, tokenizer = _rollout(tiny_model_path, tmp_path, FAILS_ON_ODD, on_error="score_zero")
    try:
        out = rollout.generate_sequences(_batch(data_dir, tokenizer))
    finally:
        rollout.close()
    index = [row["index"] for row in out.non_tensor_batch["extra_info"]]
    assert out.batch["rm_scores"].sum(-1).tolist() == [float(i % 2 == 0) for i in index]
    assert sorted(index) == [0, 0, 1, 1, 2, 2, 3, 3]  # the failed sessions' calls train too, with reward 0
    assert out.meta_info["metrics"]["served/failed_sessions"] == 0.5


def test_a_return_value_outside_the_rule_is_one_line(tiny_model_path, data_dir, tmp_path):
    rollout, tokenizer = _rollout(tiny_model_path, tmp_path, ECHO_ROW.replace('{"score"', '{"scor"'))
    try:
        with pytest.raises(
            InputError, match=r"the agent 'run' \(.*agent.py\) \(session s\w+, a generation outside"
        ):
            rollout.generate_sequences(_batch(data_dir, tokenizer, size=1))
    finally:
        rollout.close()


RAISES = """
async def run(client, sample):
    return sample["ground_truth"]  # a flattened column the file does not have
"""


def test_an_agent_that_raises_stops_train_with_one_line(tiny_model_path, data_dir, tmp_path, capsys):
    (tmp_path / "agent.py").write_text(RAISES)
    status = cli(
        [
            "train",
            f"data.train_files={data_dir / 'train.parquet'}",
            f"actor_rollout_ref.model.path={tiny_model_path}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"actor_rollout_ref.rollout.served_agent.path={tmp_path / 'agent.py'}",
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "trainer.logger=[file]",
        ]
    )
    err = capsys.readouterr().err
    keys = ", ".join(sorted({*json.loads(json.dumps(read_rows(data_dir / "train.parquet")[0])), "messages"}))
    assert status == 2
    (line,) = [line for line in err.splitlines() if line.startswith("hybridflow train: error:")]
    assert f"raised KeyError: 'ground_truth' in a session of step 1 (the sample's keys: {keys})" in line
    assert "the agent 'run' (" in line and "on_error=score_zero" in line
    assert "Traceback" not in err


@pytest.mark.parametrize("other", ["custom_reward_function.path=r.py", "reward_model.enable=true"])
def test_a_reward_the_agent_would_shadow_is_refused(data_dir, tmp_path, other):
    from hybridflow.config import ConfigError, load_config

    keys = [f"data.train_files={data_dir / 'train.parquet'}", "actor_rollout_ref.model.path=m"]
    served = f"actor_rollout_ref.rollout.served_agent.path={tmp_path / 'agent.py'}"
    with pytest.raises(ConfigError, match=f"{other.split('=')[0]} would never be used"):
        load_config([*keys, served, other, "reward_model.dummy=true"])
