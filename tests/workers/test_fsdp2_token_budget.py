"""Token-budget micro-batches under FSDP2 on 2 Ray ranks (CPU, gloo): shards of very different token lengths
need different numbers of micro-batches on their own, the ranks agree on the largest (else they would wait on
each other's all-gathers forever), and the log-probs and the update equal the 1-rank fixed-size ones; a rank
with fewer rows than the agreed count runs zero-weight fillers."""

import pytest
import torch
from test_fsdp2 import ShardProbe, ray_group
from test_shared_prompt import layout

from hybridflow import DataProto
from hybridflow.config.schema import PPOConfig
from hybridflow.single_controller import ClassWithInitArgs, Dispatch, LocalWorkerGroup, register
from hybridflow.workers.packing import MicroBatching

BUDGET = 60  # tokens: each long group of rank 0 fills a micro-batch alone, rank 1's shard fits in one


class BudgetProbe(ShardProbe):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def uneven_step(self, data: DataProto, bounds: list[int], budget: int) -> dict[str, torch.Tensor]:
        """One optimiser step in which rank r holds rows ``bounds[r]:bounds[r + 1]`` (one rank alone holds
        them all): shards of unequal sizes, so the short one must run fillers. Returns the full gradients."""
        shard = data[bounds[self.rank] : bounds[self.rank + 1]]
        self.engine.train_mini_batch(shard, MicroBatching(0, budget), self._policy_loss)
        return self.applied_grads()


def config(path: str, dynamic: bool):
    cfg = PPOConfig()
    arr = cfg.actor_rollout_ref
    arr.model.path = path
    arr.actor.strategy = "fsdp2"
    arr.rollout.n = 2
    arr.actor.ppo_mini_batch_size = 6  # prompts: the 12 rows are one optimiser step
    arr.actor.ppo_micro_batch_size_per_gpu = 2
    arr.rollout.log_prob_micro_batch_size_per_gpu = 2
    arr.actor.use_dynamic_bsz = arr.rollout.log_prob_use_dynamic_bsz = dynamic
    arr.actor.ppo_max_token_len_per_gpu = arr.rollout.log_prob_max_token_len_per_gpu = BUDGET
    arr.actor.optim.lr = 1e-3
    arr.actor.entropy_coeff = 0.01
    return cfg.resolve().actor_rollout_ref


def uneven_batch() -> DataProto:
    """12 rows: rank 0's half is 3 groups of 2 with ~30-token prompts, rank 1's half a group of 4 and a
    group of 2 with 3- and 4-token prompts; responses of 1-10 tokens; advantages of both signs."""
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, 900, (n,), generator=gen)  # noqa: E731
    rows = []
    for prompt_len, response_lens in (
        (30, (10, 8)),
        (26, (9, 10)),
        (28, (7, 10)),
        (3, (2, 1, 3, 2)),
        (4, (1, 2)),
    ):
        prompt = ids(prompt_len)
        rows += [(prompt, ids(n)) for n in response_lens]
    data = layout(rows, prompt_width=30, length=10)
    data.batch["advantages"] = torch.linspace(-1, 1, 12)[:, None].expand(-1, 10).contiguous()
    return data


def test_token_budget_ranks_agree_and_equal_the_fixed_size_update(tiny_model_path, ray_session):
    batch = uneven_batch()
    budget = MicroBatching(0, BUDGET)
    assert (budget.count(batch[:6]), budget.count(batch[6:])) == (3, 1)  # each rank's own count differs
    single = LocalWorkerGroup(ClassWithInitArgs(BudgetProbe, config(tiny_model_path, False), role="actor"))
    single.init_model()  # one rank, fixed-size micro-batches of 2 rows: the reference
    group, pool = ray_group(
        ClassWithInitArgs(BudgetProbe, config(tiny_model_path, True), role="actor"), "budget"
    )
    try:
        two_log_probs = group.compute_log_prob(batch).batch["old_log_probs"]  # forward-only passes agree
        two = group.update_actor(batch).meta_info["metrics"]
        two_grads, two_weights = group.applied_grads(), group.weights()[0]
        # rank 0 holds 2 rows but the ranks agree on >= 5 micro-batches of 20 tokens: it runs fillers
        small = MicroBatching(0, 20)
        assert small.count(batch[:2]) == 2 and small.count(batch[2:]) >= 5
        two_uneven = group.uneven_step(batch, [0, 2, 12], 20)
    finally:
        group.shutdown()
        pool.remove()
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(
        two_log_probs[mask], single.compute_log_prob(batch).batch["old_log_probs"][mask], rtol=0, atol=1e-5
    )
    one = single.update_actor(batch).meta_info["metrics"]
    one_grads = single.applied_grads()[0]
    one_weights = {name: t.clone() for name, t in single.weights()[0].items()}  # the module's own tensors
    one_uneven = single.uneven_step(batch, [0, 12], 20)[0]

    assert one_grads.keys() == two_grads[0].keys() == one_uneven.keys() and len(one_grads) > 10
    for name, grad in one_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(two_grads[0][name], two_grads[1][name], rtol=0, atol=0)
        torch.testing.assert_close(two_grads[0][name], grad, rtol=1e-4, atol=1e-7, msg=name)
        torch.testing.assert_close(two_uneven[0][name], one_uneven[name], rtol=1e-4, atol=1e-7, msg=name)
    for name, tensor in one_weights.items():
        torch.testing.assert_close(two_weights[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    assert two["actor/grad_norm"][0] == pytest.approx(one["actor/grad_norm"][0], rel=1e-5)


def critic_config(path: str, dynamic: bool):
    cfg = PPOConfig()
    cfg.actor_rollout_ref.model.path = path
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 6
    critic = cfg.critic
    critic.strategy, critic.optim.lr, critic.grad_clip = "fsdp2", 1e-3, 1e9
    critic.ppo_micro_batch_size_per_gpu, critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu = (
        2,
        dynamic,
        BUDGET,
    )
    return cfg.resolve().critic


def test_critic_values_and_update_with_token_budgets_on_two_fsdp2_ranks(tiny_model_path, ray_session):
    from hybridflow.workers import CriticWorker

    batch = uneven_batch()
    batch.batch["returns"] = batch.batch["advantages"] * batch.batch["response_mask"]
    single = LocalWorkerGroup(
        ClassWithInitArgs(CriticWorker, critic_config(tiny_model_path, False), rollout_n=2)
    )
    single.init_model()
    group, pool = ray_group(
        ClassWithInitArgs(CriticWorker, critic_config(tiny_model_path, True), rollout_n=2), "critic_budget"
    )
    try:
        two_values = group.compute_values(batch).batch["values"]
        two = group.update_critic(batch.union(DataProto.from_dict({"values": two_values})))
    finally:
        group.shutdown()
        pool.remove()
    one_values = single.compute_values(batch).batch["values"]
    one = single.update_critic(batch.union(DataProto.from_dict({"values": one_values})))
    assert one_values.abs().max() > 0
    torch.testing.assert_close(two_values, one_values, rtol=0, atol=1e-5)
    norm = "critic/grad_norm"  # the global gradient's norm: equal only if the gradients are
    assert two.meta_info["metrics"][norm][0] == pytest.approx(one.meta_info["metrics"][norm][0], rel=1e-5)
