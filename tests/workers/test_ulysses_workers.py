"""Ulysses sequence parallelism in the workers, on 4 Ray ranks (CPU, gloo) sharded with FSDP2: the actor with
sequences over groups of 2 (two data-parallel groups), the reference over all 4, and the critic over groups of
2, with token-budget micro-batches and prefix-tree packing, give the log-probs, values and gradients of one
unsharded rank with fixed-size micro-batches (the config keys are verl's ``ulysses_sequence_parallel_size``)."""

import pytest
import torch
from test_fsdp2 import ShardProbe
from test_fsdp2_token_budget import BUDGET, uneven_batch

from hybridflow import DataProto
from hybridflow.config.schema import PPOConfig
from hybridflow.single_controller import ClassWithInitArgs, LocalWorkerGroup, create_colocated_worker_cls
from hybridflow.workers import CriticWorker


def config(path: str, sequence_parallel: bool) -> PPOConfig:
    cfg = PPOConfig()
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    arr.model.path = path
    arr.rollout.n = 2
    arr.actor.ppo_mini_batch_size = 6  # prompts: the 12 rows are one optimiser step
    arr.actor.ppo_micro_batch_size_per_gpu = arr.rollout.log_prob_micro_batch_size_per_gpu = 2
    arr.ref.log_prob_micro_batch_size_per_gpu = 2
    arr.actor.optim.lr, arr.actor.entropy_coeff, arr.actor.use_kl_loss = 1e-3, 0.01, True
    critic.optim.lr, critic.grad_clip, critic.ppo_micro_batch_size_per_gpu = 1e-3, 1e9, 2
    if sequence_parallel:
        cfg.trainer.n_workers = 4
        arr.actor.strategy = critic.strategy = "fsdp2"
        arr.actor.ulysses_sequence_parallel_size = critic.ulysses_sequence_parallel_size = 2
        arr.ref.ulysses_sequence_parallel_size = 4
        arr.actor.use_dynamic_bsz = arr.rollout.log_prob_use_dynamic_bsz = critic.use_dynamic_bsz = True
        arr.ref.log_prob_use_dynamic_bsz = True
        # per rank; a group's micro-batch holds its size times as many tokens (verl's rule)
        arr.actor.ppo_max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu = BUDGET // 2
        arr.rollout.log_prob_max_token_len_per_gpu = arr.ref.log_prob_max_token_len_per_gpu = BUDGET // 2
    return cfg.resolve()


def plus(batch: DataProto, **tensors: torch.Tensor) -> DataProto:
    """A new batch: ``batch``'s tensors and ``tensors`` (``union`` would change ``batch`` itself)."""
    return DataProto.from_dict({**dict(batch.batch.items()), **tensors})


def four_ranks(init, name):
    from hybridflow.single_controller.ray import RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([4], cpus_per_process=0.5, name=name)
    return RayWorkerGroup(pool, init, name_prefix=name), pool


def test_actor_reference_and_critic_split_sequences_equal_one_rank(tiny_model_path, ray_session):
    batch = uneven_batch()
    batch.batch["returns"] = batch.batch["advantages"] * batch.batch["response_mask"]
    one_cfg, sp_cfg = config(tiny_model_path, False), config(tiny_model_path, True)
    actor = lambda cfg: ClassWithInitArgs(ShardProbe, cfg.actor_rollout_ref, role="actor_ref")  # noqa: E731
    critic = lambda cfg: ClassWithInitArgs(CriticWorker, cfg.critic, rollout_n=2)  # noqa: E731
    colocated = create_colocated_worker_cls({"actor": actor(sp_cfg), "critic": critic(sp_cfg)})
    group, pool = four_ranks(colocated, "ulysses")  # one process per rank holds both roles, as a run does
    try:
        views = group.spawn(prefix_set=["actor", "critic"])
        sp_actor, sp_critic_group = views["actor"], views["critic"]
        for view in views.values():
            view.init_model()
        sp_log_probs = sp_actor.compute_log_prob(batch).batch
        sp_ref = sp_actor.compute_ref_log_prob(batch).batch["ref_log_prob"]
        sp_update = sp_actor.update_actor(plus(batch, ref_log_prob=sp_ref))
        sp_grads = sp_actor.applied_grads()
        sp_values = sp_critic_group.compute_values(batch).batch["values"]
        sp_critic = sp_critic_group.update_critic(plus(batch, values=sp_values))
    finally:
        group.shutdown()
        pool.remove()

    single = LocalWorkerGroup(actor(one_cfg))
    single.init_model()
    mask = batch.batch["response_mask"].bool()
    one_log_probs = single.compute_log_prob(batch).batch
    for key in ("old_log_probs", "entropys"):
        torch.testing.assert_close(sp_log_probs[key][mask], one_log_probs[key][mask], rtol=0, atol=1e-5)
    one_ref = single.compute_ref_log_prob(batch).batch["ref_log_prob"]
    torch.testing.assert_close(sp_ref[mask], one_ref[mask], rtol=0, atol=1e-5)
    one_update = single.update_actor(plus(batch, ref_log_prob=one_ref))
    one_grads = single.applied_grads()[0]
    assert len(one_grads) > 10
    for name, grad in one_grads.items():
        assert grad.abs().max() > 0, name
        for rank in range(4):
            torch.testing.assert_close(sp_grads[rank][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    grad_norm = "actor/grad_norm"
    assert sp_update.meta_info["metrics"][grad_norm][0] == pytest.approx(
        one_update.meta_info["metrics"][grad_norm][0], rel=1e-5
    )

    single_critic = LocalWorkerGroup(critic(one_cfg))
    single_critic.init_model()
    one_values = single_critic.compute_values(batch).batch["values"]
    assert one_values.abs().max() > 0
    torch.testing.assert_close(sp_values, one_values, rtol=0, atol=1e-5)
    one_critic = single_critic.update_critic(plus(batch, values=one_values))
    assert sp_critic.meta_info["metrics"]["critic/grad_norm"][0] == pytest.approx(
        one_critic.meta_info["metrics"]["critic/grad_norm"][0], rel=1e-5
    )
