"""Data parallelism: one actor update on 2 Ray ranks equals the 1-rank update on the same global batch."""

import pytest
import torch

from hybridflow import DataProto
from hybridflow.algorithms import compute_advantage
from hybridflow.config.schema import PPOConfig
from hybridflow.single_controller import ClassWithInitArgs, Dispatch, LocalWorkerGroup, register
from hybridflow.workers import ActorRolloutRefWorker


class GradProbe(ActorRolloutRefWorker):
    """The actor, plus the gradients its last update applied (all-reduced across ranks; full tensors of FSDP2
    shards), kept by a hook before each optimiser step: the engine frees them after it."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        super().init_model()
        if self.engine is not None:  # a role that trains
            self.engine.optimizer.register_step_pre_hook(self._keep_grads)

    def _keep_grads(self, optimizer, args, kwargs) -> None:
        self.kept_grads = {  # full_tensor: a collective, run by every rank's step alike
            name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            for name, p in self.module.named_parameters()
            if p.grad is not None
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def applied_grads(self) -> dict[str, torch.Tensor]:
        return self.kept_grads


def config(path: str, strategy: str = "auto"):
    cfg = PPOConfig()
    arr = cfg.actor_rollout_ref
    arr.model.path = path
    arr.actor.strategy = strategy
    arr.rollout.n = 2
    arr.actor.ppo_mini_batch_size = 5  # prompts: the whole batch of 10 rows is one optimiser step
    arr.actor.ppo_micro_batch_size_per_gpu = 2  # several micro-batches accumulate on each rank
    arr.actor.optim.lr = 1e-3
    arr.actor.use_kl_loss = True
    arr.actor.entropy_coeff = 0.01
    return cfg.resolve().actor_rollout_ref


def grpo_batch(single: LocalWorkerGroup, chat_prompts) -> DataProto:
    """10 rollouts (5 prompts x 2) of ``single``'s actor with reference log-probs and GRPO advantages."""
    torch.manual_seed(0)
    questions = ["Compute 1+2.", "Compute 30+4.", "Say hi.", "Compute 7+7.", "Name a color."]
    batch = single.generate_sequences(chat_prompts(single.workers[0].tokenizer, questions))
    batch = batch.union(single.compute_ref_log_prob(batch))
    lengths = batch.batch["response_mask"].sum(-1)
    scores = torch.zeros(batch.batch["responses"].shape)
    scores[torch.arange(10), lengths - 1] = torch.arange(10, dtype=torch.float32) % 3
    batch.batch["token_level_rewards"] = scores
    return compute_advantage(batch, "grpo")


def test_two_rank_update_equals_one_rank_update(tiny_model_path, chat_prompts, ray_session):
    from hybridflow.single_controller.ray import RayResourcePool, RayWorkerGroup

    init = ClassWithInitArgs(GradProbe, config(tiny_model_path), role="actor_rollout_ref", response_length=5)
    single = LocalWorkerGroup(init)
    single.init_model()
    batch = grpo_batch(single, chat_prompts)

    pool = RayResourcePool([2], cpus_per_process=1.0, name="dp")
    group = RayWorkerGroup(pool, init, name_prefix="dp")
    try:
        group.init_model()
        two = group.update_actor(batch).meta_info["metrics"]
        two_grads = group.applied_grads()
    finally:
        group.shutdown()
        pool.remove()
    one = single.update_actor(batch).meta_info["metrics"]
    one_grads = single.applied_grads()[0]

    # both ranks applied the same (all-reduced) gradient, equal to the single rank's
    for name, grad in one_grads.items():
        torch.testing.assert_close(two_grads[0][name], two_grads[1][name], rtol=0, atol=0)
        torch.testing.assert_close(two_grads[0][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    assert two["actor/grad_norm"][0] == pytest.approx(one["actor/grad_norm"][0], rel=1e-5)
    assert two["actor/grad_norm"][0] == two["actor/grad_norm"][1]
