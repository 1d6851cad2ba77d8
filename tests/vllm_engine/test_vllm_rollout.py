"""The vLLM rollout (vLLM's CPU build, in its own environment: `make test-vllm`) against the HF path.

Greedy vLLM equals greedy ``generate`` for the same weights; after an actor update the engine holds the new
weights (its log-probs of a fixed sequence match the trainer's and differ from before); a GRPO run with
vLLM learns on the tiny model as the HF run does.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from hybridflow.config.schema import PPOConfig
from hybridflow.data.prepare import main as prepare_data
from hybridflow.models import make_tiny_model
from hybridflow.protocol import DataProto
from hybridflow.rollout import EngineSpec
from hybridflow.trainer import PPOTrainer, load_config
from hybridflow.workers import ActorRolloutRefWorker
from hybridflow.workers.modeling import load_model, load_tokenizer, response_log_probs
from hybridflow.workers.rollout import HFRollout, build_rollout
from hybridflow.workers.weight_sync import WeightMailbox

QUESTIONS = ["What is 2+3?", "Compute 14+27. Reply in the form 14+27=<answer>.", "Say hello to the teacher."]
# fp32 on both sides; the engine's fused kernels differ from transformers' in the last bits only
LOGPROB_TOL = 1e-3
# The same tests run on a GPU with the CUDA vllm package (bench/gpu_vllm_check.sh): there the engine sleeps
# between generations, and the script also runs them with tensor parallelism 2.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TP = int(os.environ.get("HYBRIDFLOW_TEST_VLLM_TP", "1"))


@pytest.fixture(scope="module")
def tiny_vllm_model(tmp_path_factory) -> str:
    """The tiny test model with head size 32: vLLM's CPU attention has no kernel for the usual 16."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-vllm") / "model", num_heads=2, num_kv_heads=1)


def _config(model: str, lr: float = 1e-2):
    cfg = PPOConfig()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, 8
    cfg.actor_rollout_ref.model.path = model
    cfg.actor_rollout_ref.model.dtype = "fp32"  # bf16 (the GPU default) would need looser tolerances
    cfg.actor_rollout_ref.rollout.name = "vllm"
    cfg.actor_rollout_ref.rollout.tensor_model_parallel_size = TP
    cfg.actor_rollout_ref.actor.optim.lr = lr
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 3
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 6
    return cfg.resolve().actor_rollout_ref


@pytest.fixture(scope="module")
def worker(tiny_vllm_model):
    worker = ActorRolloutRefWorker(_config(tiny_vllm_model), role="actor_rollout", response_length=8)
    worker.init_model()
    return worker


def _greedy(prompts: DataProto) -> DataProto:
    out = DataProto.from_dict(dict(prompts.batch.items()))
    out.meta_info["do_sample"] = False
    return out


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Larger random weights than the tiny model's init, so greedy outputs vary from token to token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def test_greedy_vllm_equals_greedy_generate_on_the_tiny_model(worker, chat_prompts):
    _randomise(worker.module, seed=1)
    worker._sync_rollout()  # the engine takes the new weights in memory
    prompts = _greedy(chat_prompts(worker.tokenizer, QUESTIONS))
    ours = worker.generate_sequences(prompts)
    hf = HFRollout(worker.module, worker.tokenizer, worker.config.rollout, 8).generate_sequences(prompts)
    assert torch.equal(ours.batch["responses"], hf.batch["responses"])
    assert len(set(ours.batch["responses"].flatten().tolist())) > 3  # varied text, not one repeated token
    for key in ("input_ids", "attention_mask", "position_ids", "response_mask", "prompts"):
        assert torch.equal(ours.batch[key], hf.batch[key]), key
    assert not ours.batch["rollout_log_probs"].any()  # greedy: no log-probs, as the HF rollout


def _engine_log_probs(worker, sequence: list[int], response_length: int) -> torch.Tensor:
    """The engine's log-probs of the last ``response_length`` tokens of a fixed ``sequence``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with worker.rollout.awake() as llm:
        [out] = llm.generate(
            [TokensPrompt(prompt_token_ids=sequence)],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
    steps = out.prompt_logprobs[-response_length:]
    return torch.tensor([step[token].logprob for step, token in zip(steps, sequence[-response_length:])])


def test_actor_update_reaches_the_engine(worker, chat_prompts):
    prompts = chat_prompts(worker.tokenizer, QUESTIONS)
    prompts.meta_info.update(n=2, temperature=1.0)
    batch = worker.generate_sequences(prompts)
    # the engine's sampled log-probs are the trainer's for the same weights (rollout/logprob_diff)
    metrics = worker.compute_log_prob(batch).meta_info["metrics"]
    assert metrics["rollout/logprob_diff_max"] < LOGPROB_TOL, metrics

    row = 0
    length = int(batch.batch["response_mask"][row].sum())
    keep = batch.batch["attention_mask"][row].bool()
    sequence = batch.batch["input_ids"][row][keep].tolist()
    before = _engine_log_probs(worker, sequence, length)
    batch.batch["advantages"] = (
        torch.where(torch.arange(len(batch))[:, None] == row, 1.0, -1.0)
        .expand_as(batch.batch["response_mask"])
        .float()
    )
    worker.update_actor(batch)
    after = _engine_log_probs(worker, sequence, length)
    trainer, _ = response_log_probs(worker.module, batch[row : row + 1], temperature=1.0)
    trainer = trainer[0, :length].detach().cpu()
    assert (after - trainer).abs().max() < LOGPROB_TOL, (after, trainer)
    assert (after - before).abs().max() > 20 * LOGPROB_TOL, "the engine still holds the old weights"


def test_partial_rollout_takes_new_weights_between_chunks(worker, chat_prompts):
    """A partial rollout decodes 3 tokens per sample at a time: with no newer weights posted it gives what one
    call gives; with version 1 posted, the first chunk is version 0's greedy text and every later token is
    version 1's greedy choice given the tokens before it (the prefix recomputed under the new weights)."""
    _randomise(worker.module, seed=1)
    worker._sync_rollout()
    prompts = _greedy(chat_prompts(worker.tokenizer, QUESTIONS))
    whole = worker.rollout.generate_sequences(prompts)
    mailbox = WeightMailbox(worker._load_weights)
    mailbox.follow = True
    worker.rollout.follow_weights(mailbox)
    worker.rollout.config.partial_rollout_chunk = 3
    try:
        chunked = worker.rollout.generate_sequences(prompts)
        mask = chunked.batch["response_mask"].bool()
        assert torch.equal(chunked.batch["responses"], whole.batch["responses"])
        assert chunked.batch["rollout_weight_versions"][mask].eq(0).all()

        current = {name: t.clone() for name, t in worker.module.state_dict().items()}
        _randomise(worker.module, seed=2)  # version 1, posted; the module and engine keep version 0
        mailbox.post(1, [(name, t.clone()) for name, t in worker.module.state_dict().items()])
        worker.module.load_state_dict(current)
        out = worker.rollout.generate_sequences(prompts)
    finally:
        worker.rollout.follow_weights(None)
        worker.rollout.config.partial_rollout_chunk = 16
    assert mailbox.version == 1
    responses, mask = out.batch["responses"], out.batch["response_mask"].bool()
    versions = out.batch["rollout_weight_versions"]
    assert torch.equal(responses[:, :3], whole.batch["responses"][:, :3])
    assert versions[:, :3][mask[:, :3]].eq(0).all() and versions[:, 3:][mask[:, 3:]].eq(1).all()
    assert mask[:, 3:].any(), "no sample outlived the first chunk"
    assert not torch.equal(responses[:, 3:], whole.batch["responses"][:, 3:])  # the new weights took over
    with torch.no_grad():  # the module holds version 1 now: its greedy choice after each prefix
        logits = worker.module(
            input_ids=out.batch["input_ids"],
            attention_mask=out.batch["attention_mask"],
            position_ids=out.batch["position_ids"],
        ).logits
    prompt_len = prompts.batch["input_ids"].shape[1]
    chosen = logits[:, prompt_len - 1 : -1].argmax(-1)
    assert torch.equal(chosen[:, 3:][mask[:, 3:]], responses[:, 3:][mask[:, 3:]])


FIRST_DIGIT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str[:1].isdigit() else 0.0
"""


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_grpo_with_vllm_learns_like_the_hf_rollout(engine, tiny_vllm_model, tmp_path):
    """The trainer test's preference task (reward: the response starts with a digit), same seed and
    settings, once per engine: both must learn it."""
    data = tmp_path / "data"
    prepare_data(["arithmetic", str(data), "--train-size", "64", "--test-size", "8", "--seed", "0"])
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(FIRST_DIGIT_REWARD)
    cfg = load_config(
        [
            f"data.train_files={data / 'train.parquet'}",
            f"actor_rollout_ref.model.path={tiny_vllm_model}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "data.max_prompt_length=64",
            "data.max_response_length=4",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "algorithm.adv_estimator=grpo",
            f"custom_reward_function.path={reward_file}",
            "trainer.logger=[file]",
            "trainer.total_training_steps=20",
            "trainer.seed=0",
            f"actor_rollout_ref.rollout.name={engine}",
            "actor_rollout_ref.model.dtype=fp32",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={TP}",
        ]
    )
    with PPOTrainer(cfg) as trainer:
        trainer.fit()
    rows = [json.loads(line) for line in Path(tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["critic/score/mean"] for row in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.3, f"{engine}: mean reward went from {first:.2f} to {last:.2f}: {rewards}"
    assert max(row["rollout/logprob_diff"] for row in rows) < LOGPROB_TOL  # the engine follows every update


# Last in the file: vLLM keeps process-wide state, and dropping an engine tears it down for any engine still
# in use, so every test that builds its own engine runs after the tests sharing the `worker` fixture.
def test_greedy_vllm_equals_greedy_generate_on_the_embedded_model(chat_prompts):
    from hybridflow.models.default import default_model_path

    path = default_model_path()
    tokenizer = load_tokenizer(path)
    module = load_model(path, DEVICE, "fp32").eval()
    config = _config(path).rollout
    engine = build_rollout(EngineSpec(config, module, tokenizer, 16, path, seed=0))
    prompts = _greedy(
        chat_prompts(
            tokenizer, ["What is 12+7?", "Compute 14+27. Reply in the form 14+27=<answer>.", "Name a colour."]
        )
    )
    ours, hf = (
        engine.generate_sequences(prompts),
        HFRollout(module, tokenizer, config, 16).generate_sequences(prompts),
    )
    texts = tokenizer.batch_decode(ours.batch["responses"], skip_special_tokens=True)
    assert torch.equal(ours.batch["responses"], hf.batch["responses"]), (
        texts,
        tokenizer.batch_decode(hf.batch["responses"], skip_special_tokens=True),
    )
    assert len(set(texts)) == 3 and all(texts), texts  # real, different answers (not empty or degenerate)
