"""FSDP2 on 2 Ray ranks (CPU, gloo): the update equals the 1-rank update on the same batch, generation with
a gathered model never deadlocks ranks whose sequences differ in length, and the sharded (DCP) checkpoint
resumes on 2 ranks and on 1 rank, with a ``huggingface/`` folder that plain transformers loads."""

import pytest
import torch
from test_data_parallel import GradProbe, config, grpo_batch
from transformers import AutoModelForCausalLM

from hybridflow.single_controller import ClassWithInitArgs, Dispatch, LocalWorkerGroup, register
from hybridflow.workers.sharding import full_weights, gathered, is_sharded
from hybridflow.workers.weight_link import MODEL_SEGMENT


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


class ShardProbe(GradProbe):
    """The actor, plus full (gathered) views of its gradients and weights: collectives on every rank."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def prefetches_only_itself(self) -> list[bool]:
        """For each FSDP2 unit, whether its backward prefetches nothing but itself (FSDP2's default when not
        told otherwise: the next unit in the reverse order of the forward)."""
        from torch.distributed.fsdp import FSDPModule

        states = [unit._get_fsdp_state() for unit in self.module.modules() if isinstance(unit, FSDPModule)]
        return [state._states_to_backward_prefetch == [state] for state in states]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, torch.Tensor]:
        return dict(full_weights(self.module))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def perturb_adapters(self) -> None:
        """Change every LoRA adapter tensor (their shards), or with no LoRA every tensor, the same way on
        every rank."""
        torch.manual_seed(1)
        lora = any("lora_" in name for name, _ in self.module.named_parameters())
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                if "lora_" in name or not lora:
                    p.add_(torch.randn_like(p) * 0.1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fills_in_place(self) -> bool:
        """Whether this rank writes its shards into the weight link's shared buckets (``weight_shards``)."""
        segments = self.weight_link.segments if self.weight_link is not None else self.shard_segments
        return bool(segments) and self._fills_in_place(self.module)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def held_by_the_link(self) -> bool:
        """Whether every tensor of this rollout worker's model lies in the weight link's model segment."""
        places = [self.weight_link.place(t) for t in self.module.state_dict().values()]
        return all(place is not None and place[0] == MODEL_SEGMENT for place in places)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def adapter_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in full_weights(self.module, adapter_only=True))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def use_version(self, version: int) -> None:
        self.mailbox.use(version)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def adam_moments(self) -> dict[str, torch.Tensor]:
        state = self.engine.optimizer.state
        return {name: full(state[p]["exp_avg"]) for name, p in self.module.named_parameters() if p in state}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generate_rank_lengths(self, input_ids: torch.Tensor) -> tuple[bool, int]:
        """Rank r generates 2 + 5r tokens: ranks run different numbers of forwards."""
        with gathered(self.module), torch.no_grad():
            out = self.module.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=2 + 5 * self.rank,
                min_new_tokens=2 + 5 * self.rank,
                do_sample=False,
                pad_token_id=0,
            )
        return is_sharded(self.module), out.shape[1] - input_ids.shape[1]


def ray_group(init, name):
    from hybridflow.single_controller.ray import RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([2], cpus_per_process=1.0, name=name)
    group = RayWorkerGroup(pool, init, name_prefix=name)
    group.init_model()
    return group, pool


def test_fsdp2_update_generation_and_resharding_checkpoints(
    tiny_model_path, chat_prompts, ray_session, tmp_path
):
    init = ClassWithInitArgs(
        ShardProbe, config(tiny_model_path, "fsdp2"), role="actor_rollout_ref", response_length=5
    )
    single = LocalWorkerGroup(init)  # fsdp2 on 1 rank: unsharded, but saving sharded (DCP) checkpoints
    single.init_model()
    batch = grpo_batch(single, chat_prompts)

    group, pool = ray_group(init, "fsdp")
    try:
        assert group.generate_rank_lengths(batch.batch["input_ids"][:2]) == [(True, 2), (True, 7)]
        ref_two = group.compute_ref_log_prob(batch).batch["ref_log_prob"]  # the reference is sharded too
        torch.testing.assert_close(ref_two, batch.batch["ref_log_prob"], rtol=1e-5, atol=1e-5)
        two = group.update_actor(batch).meta_info["metrics"]
        two_grads = group.applied_grads()
        group.save_checkpoint(str(tmp_path / "ckpt"))
        two_weights, two_moments = group.weights()[0], group.adam_moments()[0]
        two_next = group.update_actor(batch).meta_info["metrics"]
        prefetches = group.prefetches_only_itself()
    finally:
        group.shutdown()
        pool.remove()
    one = single.update_actor(batch).meta_info["metrics"]
    one_grads = single.applied_grads()[0]

    # on CPU no unit gathers the next one early in the backward: it would overlap nothing and hold two layers
    assert all(len(units) == 3 and all(units) for units in prefetches), prefetches  # 2 layers and the root
    # both ranks gathered the same gradient, equal to the single rank's
    assert one_grads.keys() == two_grads[0].keys() and len(one_grads) > 10
    for name, grad in one_grads.items():
        torch.testing.assert_close(two_grads[0][name], two_grads[1][name], rtol=0, atol=0)
        torch.testing.assert_close(two_grads[0][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    assert two["actor/grad_norm"][0] == pytest.approx(one["actor/grad_norm"][0], rel=1e-5)

    # the consolidated folder is a plain Hugging Face model holding the gathered weights
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "huggingface")
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, two_weights[name]), name
    assert sorted(p.name for p in (tmp_path / "ckpt" / "dcp").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]

    # 2 -> 1: the sharded checkpoint loads into one unsharded rank, which continues like the 2 ranks did
    resumed = LocalWorkerGroup(init)
    resumed.init_model()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    for name, tensor in resumed.weights()[0].items():
        assert torch.equal(tensor, two_weights[name]), name
    moments = resumed.adam_moments()[0]
    assert moments.keys() == two_moments.keys() and len(moments) > 10
    for name, tensor in moments.items():
        assert torch.equal(tensor, two_moments[name]), name
    one_next = resumed.update_actor(batch).meta_info["metrics"]
    for key in ("actor/grad_norm", "actor/lr"):  # global values (the losses are per rank's shard)
        assert one_next[key][0] == pytest.approx(two_next[key][0], rel=1e-4), key

    # 2 -> 2: the same world size resumes to the same continuation
    group, pool = ray_group(init, "fsdp2")
    try:
        group.load_checkpoint(str(tmp_path / "ckpt"))
        again = group.update_actor(batch).meta_info["metrics"]
    finally:
        group.shutdown()
        pool.remove()
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert again[key] == pytest.approx(two_next[key], rel=1e-6, abs=1e-7), key
