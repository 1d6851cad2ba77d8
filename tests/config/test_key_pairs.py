"""Keys that have no effect without another one (``hybridflow.config.key_pairs``): every pair of the table, set
alone, warns naming the key it needs (or is refused), and set with what it needs, says nothing."""

import warnings

import pytest

from hybridflow.config import ConfigError, UnusedKeyWarning, load_config
from hybridflow.config.key_pairs import KEY_PAIRS, OFFLINE_KEY_PAIRS, unused_keys
from hybridflow.config.offline import SFTConfig, load_offline_config

A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
RM = ["reward_model.enable=true", "reward_model.model.path=/models/rm"]
TWO = [*RM, "reward_model.two_stage.enable=true"]
KL = [f"{A}.use_kl_loss=true"]
VAL = ["data.val_files=[test.parquet]"]

# (overrides that set the key alone, the key, what the message names, what it needs to take effect); the
# last is the override list that gives it its effect (with the first list's own overrides)
PPO_CASES = [
    (["reward_model.micro_batch_size_per_gpu=4"], "reward_model.micro_batch_size_per_gpu", "reward_model.enable=true", RM),
    (["reward_model.two_stage.unselected=zero"], "reward_model.two_stage.unselected", "reward_model.enable=true", TWO),
    ([*RM, "reward_model.dummy=true"], "reward_model.model.path", "with reward_model.dummy=true", ["reward_model.dummy=false"]),
    ([*RM, "reward_model.two_stage.top_k_ratio=0.5"], "reward_model.two_stage.top_k_ratio", "two_stage.enable=true", TWO),
    ([*TWO, "reward_model.two_stage.threshold=0.5", "reward_model.two_stage.top_k_ratio=0.5"],
     "reward_model.two_stage.top_k_ratio", "threshold set", ["reward_model.two_stage.threshold=null"]),
    ([*TWO, "reward_model.two_stage.unselected_scale=0.5"], "reward_model.two_stage.unselected_scale",
     "two_stage.unselected=scale", ["reward_model.two_stage.unselected=scale"]),
    (["custom_reward_function.name=score"], "custom_reward_function.name", "custom_reward_function.path",
     ["custom_reward_function.path=/code/reward.py"]),
    (["async_training.max_staleness=3"], "async_training.max_staleness", "async_training.mode=fully_async",
     ["async_training.mode=fully_async"]),
    (["async_training.mode=one_step_off", "async_training.partial_rollout=false"], "async_training.partial_rollout",
     "async_training.mode=fully_async", ["async_training.mode=fully_async"]),
    (["actor_rollout_ref.model.lora_alpha=32"], "actor_rollout_ref.model.lora_alpha", "lora_rank > 0",
     ["actor_rollout_ref.model.lora_rank=8"]),
    ([f"{A}.checkpoint.save_lora_only=true"], f"{A}.checkpoint.save_lora_only", "lora_rank > 0",
     ["actor_rollout_ref.model.lora_rank=8"]),
    ([f"{A}.fsdp_config.param_offload=true"], f"{A}.fsdp_config.param_offload", f"{A}.strategy=fsdp2",
     [f"{A}.strategy=fsdp2"]),
    ([f"{R}.sharded_generation=true"], f"{R}.sharded_generation", f"{A}.strategy=fsdp2", [f"{A}.strategy=fsdp2"]),
    ([f"{A}.ppo_max_token_len_per_gpu=4096"], f"{A}.ppo_max_token_len_per_gpu", f"{A}.use_dynamic_bsz=true",
     [f"{A}.use_dynamic_bsz=true"]),
    ([f"{R}.log_prob_max_token_len_per_gpu=4096"], f"{R}.log_prob_max_token_len_per_gpu",
     f"{R}.log_prob_use_dynamic_bsz=true", [f"{R}.log_prob_use_dynamic_bsz=true"]),
    ([f"{A}.kl_loss_coef=0.01"], f"{A}.kl_loss_coef", f"{A}.use_kl_loss=true", KL),
    (["algorithm.kl_penalty=low_var_kl"], "algorithm.kl_penalty", "algorithm.use_kl_in_reward=true",
     ["algorithm.use_kl_in_reward=true"]),
    (["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.target_kl=0.05"], "algorithm.kl_ctrl.target_kl",
     "kl_ctrl.type=adaptive", ["algorithm.kl_ctrl.type=adaptive"]),
    (["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"], "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
     "without a reference policy", KL),
    ([*KL, "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.ref.fsdp_config.param_offload=true"],
     "actor_rollout_ref.ref.fsdp_config.param_offload", "lora_rank > 0 (the reference is the actor's module",
     ["actor_rollout_ref.model.lora_rank=0", "actor_rollout_ref.ref.strategy=fsdp2"]),
    ([*KL, "actor_rollout_ref.ref.fsdp_config.param_offload=true"], "actor_rollout_ref.ref.fsdp_config.param_offload",
     "actor_rollout_ref.ref.strategy=fsdp2", ["actor_rollout_ref.ref.strategy=fsdp2"]),
    ([*KL, "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4096"],
     "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "ref.log_prob_use_dynamic_bsz=true",
     ["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true"]),
    (["algorithm.adv_estimator=grpo", "critic.optim.lr=1e-4"], "critic.optim.lr", "without a critic",
     ["critic.enable=true"]),
    (["critic.model.fsdp_config.param_offload=true"], "critic.model.fsdp_config.param_offload",
     "critic.strategy=fsdp2", ["critic.strategy=fsdp2"]),
    (["critic.ppo_max_token_len_per_gpu=4096"], "critic.ppo_max_token_len_per_gpu", "critic.use_dynamic_bsz=true",
     ["critic.use_dynamic_bsz=true"]),
    ([f"{A}.off_policy_mask_bounds=[0.2,5.0]"], f"{A}.off_policy_mask_bounds", f"{A}.off_policy_mask",
     [f"{A}.off_policy_mask=token"]),
    (["trainer.test_freq=2"], "trainer.test_freq", "data.val_files", VAL),
    ([f"{R}.val_kwargs.n=2"], f"{R}.val_kwargs.n", "data.val_files", VAL),
    ([*VAL, f"{R}.val_kwargs.temperature=0.7"], f"{R}.val_kwargs.temperature", "val_kwargs.do_sample=false",
     [f"{R}.val_kwargs.do_sample=true"]),
    ([f"{R}.do_sample=false", f"{R}.top_k=50"], f"{R}.top_k", f"{R}.do_sample=false", [f"{R}.do_sample=true"]),
    (["data.sft.loss_coef=0.5"], "data.sft.loss_coef", "data.sft.files", ["data.sft.files=[sft.parquet]"]),
    ([f"{R}.multi_turn.max_assistant_turns=3"], f"{R}.multi_turn.max_assistant_turns", "multi_turn.enable=true",
     [f"{R}.multi_turn.enable=true"]),
    ([f"{R}.served_agent.batch_window_ms=5"], f"{R}.served_agent.batch_window_ms", "served_agent.path",
     [f"{R}.served_agent.path=/code/agent.py"]),
    (["replay_buffer.capacity=64"], "replay_buffer.capacity", "replay_buffer.enable=true", ["replay_buffer.enable=true"]),
    (["trainer.cpus_per_worker=0.5"], "trainer.cpus_per_worker", "trainer.backend=ray", ["trainer.backend=ray"]),
    ([f"{R}.weight_sync_bucket_mb=16"], f"{R}.weight_sync_bucket_mb", "trainer.backend=ray", ["trainer.backend=ray"]),
]  # fmt: skip
OFFLINE_CASES = [
    (["model.lora_alpha=32"], "model.lora_alpha", "model.lora_rank > 0", ["model.lora_rank=8"]),
    (["data.max_token_len_per_gpu=512"], "data.max_token_len_per_gpu", "data.use_dynamic_bsz=true",
     ["data.use_dynamic_bsz=true"]),
    (["trainer.test_freq=2"], "trainer.test_freq", "data.val_files", VAL),
]  # fmt: skip


def ppo(overrides: list[str]):
    return load_config(["data.train_files=[train.parquet]", *overrides])


def sft(overrides: list[str]):
    return load_offline_config(SFTConfig, ["data.train_files=[train.parquet]", *overrides])


def unused_warnings(load, overrides: list[str]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(overrides)
    return [str(w.message) for w in caught if issubclass(w.category, UnusedKeyWarning)]


CASES = [(ppo, *case) for case in PPO_CASES] + [(sft, *case) for case in OFFLINE_CASES]


@pytest.mark.parametrize(("load", "alone", "key", "needs", "fix"), CASES, ids=[c[2] for c in CASES])
def test_a_key_set_without_what_it_needs_warns_naming_it(load, alone, key, needs, fix):
    (message,) = [m for m in unused_warnings(load, alone) if m.startswith(f"{key} = ")]
    assert " has no effect " in message and needs in message
    assert not [m for m in unused_warnings(load, [*alone, *fix]) if m.startswith(f"{key} = ")]


def test_every_pair_of_the_tables_has_a_case():
    hit = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedKeyWarning)
        for load, alone, key, *_ in CASES:
            cfg = load(alone)
            pairs = KEY_PAIRS if load is ppo else OFFLINE_KEY_PAIRS
            hit |= {pair for k, _, pair in unused_keys(cfg, type(cfg)(), pairs) if k == key}
    assert hit == set(KEY_PAIRS[1:] + OFFLINE_KEY_PAIRS)  # the first, the refused dummy, has its own test


def test_the_dummy_reward_model_alone_is_refused_naming_the_key_it_needs():
    """Before: ``reward_model.dummy=true`` alone ran the rule scorers instead, silently."""
    with pytest.raises(ConfigError) as refused:
        ppo(["reward_model.dummy=true"])
    assert str(refused.value).startswith(
        "reward_model.dummy=true has no effect without reward_model.enable=true"
    )
    assert ppo(["reward_model.dummy=true", "reward_model.enable=true"]).reward_model.dummy


def test_defaults_and_derived_values_never_warn():
    """``PPOConfig()``'s values, and what resolving derives (the critic's path and sizes from the actor's,
    ``auto`` strategies and dtypes, seeds), are not something a user set."""
    assert unused_warnings(ppo, []) == []
    assert (
        unused_warnings(ppo, ["algorithm.adv_estimator=grpo", f"{A}.strategy=fsdp2", "trainer.seed=7"]) == []
    )
    assert unused_warnings(sft, []) == []
