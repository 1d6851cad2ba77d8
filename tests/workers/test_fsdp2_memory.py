"""FSDP2 memory on 2 Ray ranks (CPU, gloo): only rank 0 reads the checkpoint, one tensor at a time (both ranks
build the model with its parameters on the meta device and receive their shards), generation without gathering the whole model steps the ranks together
and samples what generation from the gathered model samples, and saving the consolidated Hugging Face folder
holds no more than two gathered tensors at once on any rank."""

import sys
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
from hybridflow.workers.weight_files import SafetensorsFolder


class LoadProbe(ActorRolloutRefWorker):
    """The actor and reference, recording how this rank reads their checkpoint while it builds them: the files
    transformers opens, the tensors read one at a time, and the most of those alive at once."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.opened, self.read, alive = [], [], []
        self.most_alive = 0
        real_open, real_read = hf_modeling.safe_open, SafetensorsFolder.__getitem__

        def spy_open(path, *args, **kwargs):
            self.opened.append(str(path))
            return real_open(path, *args, **kwargs)

        def spy_read(files, name):
            tensor = real_read(files, name)
            self.read.append(name)
            alive.append(weakref.ref(tensor))
            self.most_alive = max(self.most_alive, sum(ref() is not None for ref in alive))
            return tensor

        with (
            mock.patch.object(hf_modeling, "safe_open", spy_open),
            mock.patch.object(SafetensorsFolder, "__getitem__", spy_read),
        ):
            super().init_model()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reading(self) -> tuple[int, list[str], int]:
        return len(self.opened), self.read, self.most_alive

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
    def loaded_aiohttp(self) -> bool:
        """Whether the served rollout's web stack (aiohttp, ~8 MiB a process) was loaded; pyarrow is not asked
        about: Ray imports it into every worker itself (its serializers for Ray Data)."""
        return "aiohttp" in sys.modules

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
        reading = group.reading()
        weights = group.weights()
        prompts = chat_prompts(_tokenizer(tiny_model_path), ["Compute 1+2.", "Say hi."])
        gathered_out = group.greedy(prompts, False)
        sharded_out = group.greedy(prompts, True)
        holding = group.save_holding(str(tmp_path / "ckpt"))
        loaded_aiohttp = group.loaded_aiohttp()
    finally:
        group.shutdown()
        pool.remove()
    # rank 0 reads every tensor of the checkpoint once for the actor and once for the reference, one at a time
    # (when it reads one, the others are gone but for what gloo may still hold: its two worker threads release a
    # finished broadcast's tensor a moment after the call returns); rank 1 reads nothing, and transformers
    # loads no whole model
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    parameters = [name for name in plain if name != "lm_head.weight"]  # tied to the embedding: stored once
    (opened0, read0, alive0), (opened1, read1, _) = reading
    assert (opened0, opened1, read1) == (0, 0, [])
    assert sorted(read0) == sorted(parameters * 2) and alive0 <= 3
    for rank in (0, 1):
        assert weights[rank]["sharded"]
        for role in ("actor", "ref"):
            assert weights[rank][role].keys() == plain.keys()
            for name, tensor in plain.items():
                assert torch.equal(weights[rank][role][name], tensor), (rank, role, name)
    assert [len(rows[0]) for rows in sharded_out] == [2, 7]
    assert sharded_out == gathered_out
    # the full tensors for the consolidated folder are gathered to rank 0 alone (rank 1 only sends its shards),
    # which drops each once written: alive at once are the one just gathered, the one before it and at most two
    # more that gloo's threads still hold, never the whole model (21 tensors)
    assert [count for count, _ in holding] == [len(plain), 0] and all(most <= 4 for _, most in holding)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "huggingface").state_dict()
    for name, tensor in plain.items():
        assert torch.equal(saved[name], tensor), name
    # a Ray worker that built, generated and saved did not load the server's web stack
    assert loaded_aiohttp == [False, False]


def _tokenizer(path: str):
    from hybridflow.workers.modeling import load_tokenizer

    return load_tokenizer(path)
