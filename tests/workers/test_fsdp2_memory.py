"""FSDP2 memory on 2 Ray ranks (CPU, gloo): only rank 0 reads the checkpoint (rank 1 builds on the meta
device and receives its shards), generation without gathering the whole model steps the ranks together
and samples what generation from the gathered model samples, and saving the consolidated Hugging Face folder
holds no more than two gathered tensors at once on any rank."""

import weakref
from unittest import mock

import torch
import transformers.modeling_utils as hf_modeling
from test_data_parallel import config
from test_fsdp2 import ray_group
from transformers import AutoModelForCausalLM

from hybridflow.single_controller import ClassWithInitArgs, Dispatch, register
from hybridflow.workers import ActorRolloutRefWorker, checkpointing
from hybridflow.workers.sharding import full_weights, gathered, is_sharded, lockstep


class LoadProbe(ActorRolloutRefWorker):
    """The actor and reference, counting the weight files this rank opens while it builds them."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.opened, real = [], hf_modeling.safe_open

        def spy(path, *args, **kwargs):
            self.opened.append(str(path))
            return real(path, *args, **kwargs)

        with mock.patch.object(hf_modeling, "safe_open", spy):
            super().init_model()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def files_opened(self) -> int:
        return len(self.opened)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, torch.Tensor]:
        return {
            "actor": dict(full_weights(self.module)),
            "ref": dict(full_weights(self.ref_module)),
            "sharded": is_sharded(self.module) and is_sharded(self.ref_module),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_holding(self, path: str) -> tuple[int, int]:
        """Save a checkpoint; returns (full tensors gathered, the most of them alive at once on this rank)."""
        alive, real = [], checkpointing.full_weights
        most = 0

        def spy(*args, **kwargs):
            nonlocal most
            for name, tensor in real(*args, **kwargs):
                alive.append(weakref.ref(tensor))
                most = max(most, sum(ref() is not None for ref in alive))
                yield name, tensor

        with mock.patch.object(checkpointing, "full_weights", spy):
            self.save_checkpoint(path)
        return len(alive), most

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def greedy(self, prompts, sharded: bool) -> list[list[int]]:
        """Rank r decodes 2 + 5r tokens from the same prompts, so the ranks run different numbers of forwards."""
        self.rollout.response_length = 2 + 5 * self.rank
        prompts.meta_info.update({"do_sample": False, "n": 1})
        with (lockstep if sharded else gathered)(self.module):
            out = self.rollout.generate_sequences(prompts)
        return out.batch["responses"].tolist()


def test_rank0_reads_the_checkpoint_and_sharded_generation_matches_gathered(
    tiny_model_path, chat_prompts, ray_session, tmp_path
):
    init = ClassWithInitArgs(LoadProbe, config(tiny_model_path, "fsdp2"), role="actor_rollout_ref")
    group, pool = ray_group(init, "fsdpmem")
    try:
        opened = group.files_opened()
        weights = group.weights()
        prompts = chat_prompts(_tokenizer(tiny_model_path), ["Compute 1+2.", "Say hi."])
        gathered_out = group.greedy(prompts, False)
        sharded_out = group.greedy(prompts, True)
        holding = group.save_holding(str(tmp_path / "ckpt"))
    finally:
        group.shutdown()
        pool.remove()
    # actor and reference each read once, on rank 0 only
    assert opened[0] >= 2 and opened[1] == 0, opened
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    for rank in (0, 1):
        assert weights[rank]["sharded"]
        for role in ("actor", "ref"):
            assert weights[rank][role].keys() == plain.keys()
            for name, tensor in plain.items():
                assert torch.equal(weights[rank][role][name], tensor), (rank, role, name)
    assert [len(rows[0]) for rows in sharded_out] == [2, 7]
    assert sharded_out == gathered_out
    # every rank gathers each full tensor for the consolidated folder and drops it once written (rank 0) or at
    # once (the others): the one just gathered and the one before it, never the whole model
    assert holding == [(len(plain), 2), (len(plain), 2)], holding
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "huggingface").state_dict()
    for name, tensor in plain.items():
        assert torch.equal(saved[name], tensor), name


def _tokenizer(path: str):
    from hybridflow.workers.modeling import load_tokenizer

    return load_tokenizer(path)
