"""The rollout contract: an engine is one class and one registration, and the trainer drives it by name
(a GRPO step through a scripted engine, on its own and under the agent loop); what it declares decides what
the worker does with it; the per-token weight-version tag; the old import paths still work, with a warning."""

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.config import ConfigError, load_config
from hybridflow.protocol import DataProto
from hybridflow.rollout import (
    Capabilities,
    EngineSpec,
    Rollout,
    SamplingParams,
    assemble_rollout,
    register_rollout,
    registry,
    rollout_class,
    tag_weight_versions,
)
from hybridflow.trainer import PPOTrainer

FIRST_DIGIT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str[:1].isdigit() else 0.0
"""
REPLIES = ["7", "no"]  # alternate rows: every GRPO group holds a rewarded and an unrewarded reply


class ScriptedRollout(Rollout):
    """A trivial engine: answers the rows alternately with ``REPLIES`` (then EOS), greedy (no log-probs). It
    declares weights of its own, so the worker must send it every update."""

    capabilities = Capabilities(own_weights=True)
    built: list["ScriptedRollout"] = []

    def __init__(self, spec: EngineSpec) -> None:
        self.spec, self.received = spec, []
        self.eos_token_ids = [spec.tokenizer.eos_token_id]
        ScriptedRollout.built.append(self)

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> "ScriptedRollout":
        return cls(spec)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        params = SamplingParams.from_config(self.spec.config, self.spec.response_length, prompts.meta_info)
        rows = prompts.repeat(params.n, interleave=True)
        tokenizer = self.spec.tokenizer
        responses = torch.full((len(rows), params.response_length), tokenizer.pad_token_id)
        for i in range(len(rows)):
            ids = tokenizer(REPLIES[i % 2], add_special_tokens=False)["input_ids"] + self.eos_token_ids
            responses[i, : len(ids)] = torch.tensor(ids[: params.response_length])
        log_probs = torch.zeros(responses.shape)
        return assemble_rollout(rows, responses, log_probs, self.eos_token_ids, tokenizer.pad_token_id)

    def update_weights(self, weights) -> int:
        self.received.append({name: tensor.clone() for name, tensor in weights})
        return len(self.received[-1])


@pytest.fixture
def scripted():
    ScriptedRollout.built.clear()
    register_rollout("scripted")(ScriptedRollout)  # the one registration
    yield ScriptedRollout
    registry._ENGINES.pop("scripted")


def _config(data_dir: Path, model: str, tmp_path: Path, *extra: str):
    (tmp_path / "reward.py").write_text(FIRST_DIGIT_REWARD)
    return load_config(
        [
            f"data.train_files={data_dir / 'train.parquet'}",
            f"actor_rollout_ref.model.path={model}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"custom_reward_function.path={tmp_path / 'reward.py'}",
            "actor_rollout_ref.rollout.name=scripted",
            "algorithm.adv_estimator=grpo",
            "data.max_prompt_length=64",
            "data.max_response_length=4",
            "data.train_batch_size=2",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "trainer.logger=[file]",
            *extra,
        ]
    )


@pytest.mark.parametrize("multi_turn", [False, True], ids=["engine", "agent_loop"])
def test_a_registered_engine_runs_a_grpo_step(scripted, data_dir, tiny_model_path, tmp_path, multi_turn):
    extra = ["actor_rollout_ref.rollout.multi_turn.enable=true"] if multi_turn else []
    batches = []
    with PPOTrainer(_config(data_dir, tiny_model_path, tmp_path, *extra)) as trainer:
        trainer.register_hook("after_advantage", lambda t, step, metrics, batch: batches.append(batch))
        trainer.fit()
    (engine,) = scripted.built
    trained = {name: p.detach() for name, p in engine.spec.module.named_parameters()}  # the actor's module
    batch = batches[0]
    texts = engine.spec.tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    assert texts == ["7", "no", "7", "no"]  # the scripted replies are the batch's responses
    assert batch.batch["token_level_scores"].sum(-1).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert (batch.batch["advantages"][0::2] > 0).any() and (batch.batch["advantages"][1::2] < 0).any()
    # the engine declared weights of its own: the update's weights were sent to it, through the agent loop too
    (sent,) = engine.received
    assert set(trained) <= set(sent)
    assert all(torch.equal(sent[name], trained[name]) for name in trained)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["critic/score/mean"] == 0.5


class Forgetful(ScriptedRollout):
    """An engine with weights of its own that takes none of what it is sent (a filter on the wrong names)."""

    def update_weights(self, weights) -> int:
        super().update_weights(weights)
        return 0


@pytest.mark.parametrize("engine", [ScriptedRollout, Forgetful], ids=["takes them", "takes none"])
def test_a_rollout_worker_of_its_own_passes_the_weights_to_an_engine_with_its_own(
    scripted, data_dir, tiny_model_path, tmp_path, engine
):
    """One step off (a rollout worker of its own): the actor's update reaches the rollout worker's module,
    checked against the trainer's checksum, and then its engine (``own_weights``), which must say it took
    every tensor: an engine that took fewer stops the run naming the version."""
    from hybridflow.workers.weight_link import WeightSyncError

    name = "scripted" if engine is ScriptedRollout else "forgetful"
    register_rollout(name)(engine)
    config = _config(
        data_dir,
        tiny_model_path,
        tmp_path,
        f"actor_rollout_ref.rollout.name={name}",
        "async_training.mode=one_step_off",
        "trainer.total_training_steps=3",
    )
    try:
        with PPOTrainer(config) as trainer:
            if engine is Forgetful:
                with pytest.raises(WeightSyncError, match=r"took 0 of the \d+ tensors of weight version 1"):
                    trainer.fit()
                return
            trainer.fit()
    finally:
        registry._ENGINES.pop("forgetful", None)
    (built,) = scripted.built  # the rollout worker's engine: the actor's worker has none
    (version_1,) = (
        built.received
    )  # the third batch was drawn by version 1 (one step off), the update of step 1
    # the rollout worker's module, loaded in place and checked: every tensor once (the tied lm_head is the
    # embedding, sent under its first name)
    held = dict(built.spec.module.named_parameters())
    assert set(version_1) == set(held) and all(torch.equal(version_1[k], held[k]) for k in held)
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters())
    assert any(
        not torch.equal(version_1[k], initial[k]) for k in initial
    )  # the trained weights, not the start


def test_the_driver_hands_the_engine_to_rays_workers(
    scripted, data_dir, tiny_model_path, tmp_path, ray_session
):
    """Registered in the driver only: Ray's worker process has no "scripted" in its registry, and builds the
    class the trainer hands it (shipped by value, as cloudpickle ships a class of the driver's __main__)."""
    import cloudpickle

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        with PPOTrainer(_config(data_dir, tiny_model_path, tmp_path, "trainer.backend=ray")) as trainer:
            trainer.fit()
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    assert scripted.built == []  # built in the worker process, not here
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["critic/score/mean"] == 0.5  # its scripted replies, scored


def test_an_unknown_engine_is_refused_before_any_worker_starts(data_dir, tiny_model_path, tmp_path):
    config = _config(data_dir, tiny_model_path, tmp_path)  # the name is not registered in this test
    with PPOTrainer(config) as trainer:
        with pytest.raises(ConfigError, match=r"rollout.name: no rollout engine 'scripted' .* hf, vllm"):
            trainer.init_workers()
        assert trainer.wg is None


def test_a_partial_rollout_needs_an_engine_that_follows_weights(
    scripted, data_dir, tiny_model_path, tmp_path
):
    from hybridflow.trainer.worker_groups import rollout_engine

    config = _config(data_dir, tiny_model_path, tmp_path, "async_training.mode=fully_async")
    with pytest.raises(
        ConfigError, match="engine 'scripted' does not declare .*follows_weights.*partial_rollout=false"
    ):
        rollout_engine(config)
    hf = rollout_class("hf").capabilities
    assert hf == Capabilities(own_weights=False, follows_weights=True, records_routing=True)
    assert rollout_class("vllm").capabilities == Capabilities(
        own_weights=True, follows_weights=True, records_routing=True
    )


def test_a_taken_name_is_refused(scripted):
    class Other(ScriptedRollout):
        pass

    with pytest.raises(ValueError, match="'scripted' is registered already"):
        register_rollout("scripted")(Other)
    assert rollout_class("scripted") is ScriptedRollout


def test_one_tag_for_the_weight_versions():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    batch = DataProto.from_dict({"response_mask": mask})
    assert tag_weight_versions(batch, 3).batch["rollout_weight_versions"].tolist() == [
        [3, 3, -1],
        [3, -1, -1],
    ]
    per_token = torch.tensor([[4, 5, 5], [4, 4, 9]])
    tagged = tag_weight_versions(batch, per_token).batch["rollout_weight_versions"]
    assert tagged.tolist() == [[4, 5, -1], [4, -1, -1]]


def test_the_old_paths_still_work_with_a_warning():
    from hybridflow import rollout
    from hybridflow.rollout import chat_template

    with pytest.warns(DeprecationWarning, match="moved to hybridflow.rollout.SamplingParams"):
        from hybridflow.workers.rollout.hf_rollout import SamplingParams as old
    assert old is rollout.SamplingParams
    with pytest.warns(DeprecationWarning, match="moved to hybridflow.rollout.attach_responses"):
        from hybridflow.workers.rollout import hf_rollout

        assert hf_rollout.attach_responses is rollout.attach_responses
    with pytest.warns(DeprecationWarning, match="moved to hybridflow.rollout.chat_template.TemplateDelta"):
        from hybridflow.workers.rollout.chat_template import TemplateDelta
    assert TemplateDelta is chat_template.TemplateDelta
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from hybridflow.workers.rollout import HFRollout  # not moved: no warning

        assert HFRollout is rollout_class("hf")
