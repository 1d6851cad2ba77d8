import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow import DataProto, generation_batch
from hybridflow.algorithms import compute_advantage
from hybridflow.config.schema import PPOConfig
from hybridflow.rollout import response_mask_from
from hybridflow.single_controller import ClassWithInitArgs, LocalWorkerGroup, WorkerError
from hybridflow.workers import ActorRolloutRefWorker


def actor_config(path: str, **actor_overrides):
    cfg = PPOConfig()
    arr = cfg.actor_rollout_ref
    arr.model.path = path
    arr.rollout.n = 2
    arr.actor.ppo_mini_batch_size = 2
    arr.actor.ppo_micro_batch_size_per_gpu = 2
    arr.actor.optim.lr = 1e-2
    for key, value in actor_overrides.items():
        setattr(arr.actor, key, value)
    return cfg.resolve().actor_rollout_ref


@pytest.fixture(scope="module")
def actor_group(tiny_model_path):
    group = LocalWorkerGroup(
        ClassWithInitArgs(
            ActorRolloutRefWorker, actor_config(tiny_model_path), role="actor_rollout_ref", response_length=6
        )
    )
    group.init_model()
    return group


def test_response_mask_ends_at_first_eos():
    responses = torch.tensor([[5, 7, 2, 9, 2], [2, 4, 4, 4, 4], [3, 3, 3, 3, 3]])
    assert response_mask_from(responses, [2]).tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_generate_sequences_layout(actor_group, chat_prompts):
    worker = actor_group.workers[0]
    prompts = chat_prompts(worker.tokenizer, ["Compute 1+2.", "Say hello to the world please."])
    prompt_len = prompts.batch["input_ids"].shape[1]
    out = actor_group.generate_sequences(prompts)  # n=2 from the rollout config
    assert len(out) == 4 and out.non_tensor_batch["uid"].tolist() == ["p0", "p0", "p1", "p1"]
    assert out.batch["responses"].shape == (4, 6) and out.batch["input_ids"].shape == (4, prompt_len + 6)
    assert torch.equal(
        out.batch["input_ids"][:, :prompt_len], prompts.batch["input_ids"].repeat_interleave(2, 0)
    )
    mask = out.batch["response_mask"]
    assert torch.equal(out.batch["attention_mask"][:, prompt_len:], mask)
    # positions continue after the prompt's last position
    last = prompts.batch["position_ids"][:, -1].repeat_interleave(2)
    assert torch.equal(out.batch["position_ids"][:, prompt_len:], last[:, None] + torch.arange(1, 7))
    # the rollout's own log-probs agree with a fresh forward pass of the trainer
    lp = actor_group.compute_log_prob(out)
    assert lp.batch["old_log_probs"].shape == (4, 6) and lp.batch["entropys"].shape == (4, 6)
    diff = (lp.batch["old_log_probs"] - out.batch["rollout_log_probs"]).abs() * mask
    assert diff.max() < 1e-4
    assert lp.meta_info["metrics"]["rollout/logprob_diff"][0] < 1e-4  # one entry per rank


def test_greedy_generation_matches_transformers(actor_group, chat_prompts, tiny_model_path):
    worker = actor_group.workers[0]
    prompts = chat_prompts(worker.tokenizer, ["What is 12+7?"])
    prompts.meta_info.update(do_sample=False, n=1)
    out = actor_group.generate_sequences(prompts)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    # The worker's weights may have been trained by another test: compare against its own module.
    reference.load_state_dict(worker.module.state_dict())
    expected = reference.generate(
        prompts.batch["input_ids"],
        attention_mask=prompts.batch["attention_mask"],
        do_sample=False,
        max_new_tokens=6,
        pad_token_id=worker.tokenizer.pad_token_id,
    )
    n = int(out.batch["response_mask"].sum())
    assert (
        out.batch["responses"][0, :n].tolist()
        == expected[0, prompts.batch["input_ids"].shape[1] :][:n].tolist()
    )


@pytest.mark.learning
def test_update_actor_raises_log_prob_of_rewarded_response(actor_group, chat_prompts):
    worker = actor_group.workers[0]
    torch.manual_seed(0)
    out = actor_group.generate_sequences(chat_prompts(worker.tokenizer, ["Compute 3+4."]))
    out = out.union(actor_group.compute_ref_log_prob(out))
    scores = torch.zeros(2, 6)
    last = out.batch["response_mask"].sum(-1) - 1
    scores[0, last[0]] = 1.0  # the first sample is good, the second bad
    out.batch["token_level_rewards"] = scores
    out = compute_advantage(out, "grpo")
    before = actor_group.compute_log_prob(out).batch["old_log_probs"]
    metrics = actor_group.update_actor(out).meta_info["metrics"]
    after = actor_group.compute_log_prob(out).batch["old_log_probs"]
    mask = out.batch["response_mask"].float()
    gain = ((after - before) * mask).sum(-1)
    assert gain[0] > 0 > gain[1]
    assert metrics["actor/lr"] == [1e-2] and metrics["actor/grad_norm"][0] > 0
    # the gradients are freed once applied: not held through the next generation and passes
    assert all(p.grad is None for p in worker.module.parameters())
    # on-policy shortcut: the ratio starts at exactly 1, so the KL to the old policy and the clip fractions are 0
    # by construction and left out; given the old log-probs (the data used again), they are reported
    assert not {"actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower"} & set(metrics)
    out.batch["old_log_probs"] = before
    again = actor_group.update_actor(out).meta_info["metrics"]
    assert again["actor/ppo_kl"][0] != 0 and 0 <= again["actor/pg_clipfrac"][0] <= 1


def test_nan_advantages_stop_with_a_clear_error(actor_group, chat_prompts):
    worker = actor_group.workers[0]
    out = actor_group.generate_sequences(chat_prompts(worker.tokenizer, ["Compute 1+1."]))
    out.batch["advantages"] = torch.full((2, 6), float("nan"))
    weights = {k: v.clone() for k, v in worker.module.state_dict().items()}
    with pytest.raises(Exception, match=r"actor: the loss is nan .*no update was applied"):
        actor_group.update_actor(out)
    assert all(torch.equal(weights[k], v) for k, v in worker.module.state_dict().items())


def test_checkpoint_is_a_plain_hf_folder_and_restores_state(actor_group, tmp_path):
    worker = actor_group.workers[0]
    actor_group.save_checkpoint(str(tmp_path / "actor"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "actor" / "huggingface")
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, worker.module.state_dict()[key]), key
    saved = {k: v.clone() for k, v in worker.module.state_dict().items()}
    lr_scale = worker.engine.lr_scale
    with torch.no_grad():
        for p in worker.module.parameters():
            p.add_(1.0)
    actor_group.scale_lr(0.5)
    actor_group.load_checkpoint(str(tmp_path / "actor"))
    assert all(torch.equal(saved[k], v) for k, v in worker.module.state_dict().items())
    assert worker.engine.lr_scale == lr_scale


def test_scale_lr_halves_the_learning_rate(tiny_model_path):
    group = LocalWorkerGroup(
        ClassWithInitArgs(ActorRolloutRefWorker, actor_config(tiny_model_path), role="actor")
    )
    group.init_model()
    assert group.scale_lr(0.5) == [pytest.approx(5e-3)]
    assert group.workers[0].engine.lr == pytest.approx(5e-3)


def test_missing_role_is_a_clear_error(tiny_model_path, chat_prompts):
    group = LocalWorkerGroup(
        ClassWithInitArgs(ActorRolloutRefWorker, actor_config(tiny_model_path), role="ref")
    )
    group.init_model()
    with pytest.raises(Exception, match="generate_sequences needs the 'rollout' role"):
        group.generate_sequences(chat_prompts(group.workers[0].tokenizer, ["hi"]))
    with pytest.raises(ValueError, match=r"unknown role part\(s\) \['critic'\]"):
        ActorRolloutRefWorker(actor_config(tiny_model_path), role="actor_critic")


def test_generation_batch_from_strings_and_chat_messages(actor_group, chat_prompts):
    """The helper builds what the dataset builds: left-padded, positions counting real tokens only."""
    tokenizer = actor_group.workers[0].tokenizer
    questions = ["Compute 1+2.", "Say hello to the world please."]
    batch = generation_batch([questions[0], [{"role": "user", "content": questions[1]}]], tokenizer)
    expected = chat_prompts(tokenizer, questions)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(batch.batch[key], expected.batch[key]), key
    assert batch.batch["attention_mask"][0, 0] == 0 and batch.batch["attention_mask"][:, -1].tolist() == [
        1,
        1,
    ]
    assert batch.non_tensor_batch["raw_prompt"][0] == [{"role": "user", "content": questions[0]}]
    out = actor_group.generate_sequences(batch)
    assert out.batch["responses"].shape == (4, 6)
    plain = generation_batch(["a b", "a"], tokenizer, apply_chat_template=False)  # a base model's prompt text
    ids = tokenizer(["a b", "a"], add_special_tokens=False)["input_ids"]
    assert plain.batch["input_ids"][1, -len(ids[1]) :].tolist() == ids[1]
    assert plain.batch["attention_mask"].sum(-1).tolist() == [len(ids[0]), len(ids[1])]


def test_generate_sequences_refuses_what_is_not_a_generation_batch(actor_group, chat_prompts):
    """A right-padded batch used to generate garbage silently; one without position_ids raised a raw KeyError."""
    tokenizer = actor_group.workers[0].tokenizer
    left = chat_prompts(tokenizer, ["Compute 1+2.", "Say hello to the world please."])
    tokenizer.padding_side = "right"
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in ["Compute 1+2.", "Say hello to the world please."]
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    tokenizer.padding_side = "left"
    right = DataProto.from_dict(
        {
            "input_ids": enc.input_ids,
            "attention_mask": enc.attention_mask,
            "position_ids": (enc.attention_mask.cumsum(-1) - 1).clamp(min=0),
        }
    )
    with pytest.raises(
        WorkerError,
        match=r"prompt row\(s\) \[0\] end in padding .* right-padded.*"
        r"hybridflow.generation_batch",
    ):
        actor_group.generate_sequences(right)
    no_positions = DataProto.from_dict({k: left.batch[k] for k in ("input_ids", "attention_mask")})
    with pytest.raises(WorkerError, match=r"the batch has no position_ids; .*hybridflow.generation_batch"):
        actor_group.generate_sequences(no_positions)


def test_update_reports_the_kl_to_the_reference(actor_group, chat_prompts):
    """actor/kl_ref is KL(policy || reference) (k1 over the sampled tokens), not how far one update moved
    the policy (actor/ppo_kl, 0 by construction with one on-policy epoch, so not logged)."""
    worker = actor_group.workers[0]
    out = actor_group.generate_sequences(chat_prompts(worker.tokenizer, ["Compute 5+6."]))
    current = actor_group.compute_log_prob(out).batch["old_log_probs"]
    out.batch["ref_log_prob"] = current - 0.05 * out.batch["response_mask"]  # the reference: 0.05 nats below
    out.batch["advantages"] = torch.zeros_like(current)
    metrics = actor_group.update_actor(out).meta_info["metrics"]
    assert metrics["actor/kl_ref"][0] == pytest.approx(0.05, abs=1e-4) and "actor/ppo_kl" not in metrics


def test_tis_caps_the_rollout_trainer_ratio(tiny_model_path, chat_prompts):
    """With actor.tis_imp_ratio_cap, tokens whose trainer/rollout probability ratio exceeds the cap are
    counted (actor/tis_clipfrac): here the rollout's log-probs are lowered by 1 on every second token."""
    group = LocalWorkerGroup(
        ClassWithInitArgs(
            ActorRolloutRefWorker,
            actor_config(tiny_model_path, tis_imp_ratio_cap=2.0),
            role="actor_rollout",
            response_length=6,
        )
    )
    group.init_model()
    torch.manual_seed(0)
    out = group.generate_sequences(chat_prompts(group.workers[0].tokenizer, ["Compute 3+4."]))
    mask = out.batch["response_mask"]
    shifted = torch.zeros_like(out.batch["rollout_log_probs"])
    shifted[:, ::2] = 1.0  # ratio e^1 = 2.7 > cap on these tokens, ~1 elsewhere
    out.batch["rollout_log_probs"] = out.batch["rollout_log_probs"] - shifted
    out.batch["advantages"] = torch.ones_like(mask, dtype=torch.float32)
    metrics = group.update_actor(out).meta_info["metrics"]
    expected = float((shifted * mask).sum() / mask.sum())
    assert metrics["actor/tis_clipfrac"][0] == pytest.approx(expected)
    assert 1.0 < metrics["actor/tis_weight_mean"][0] < 2.0
