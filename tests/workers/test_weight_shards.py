"""``weight_shards``: a 3-rank FSDP2 actor fills the weight link's shared-memory buckets with its own shards,
each rank in place, and a rollout process receives the whole model bit for bit, checked against the
trainer's checksum, while nothing larger than the checksums crosses the actor's group. Over 3 ranks most
tensors' rows do not divide evenly, a 2-row tensor leaves a rank empty, and some tensors' parts are not
whole 8-byte words (their checksum is read back whole)."""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from hybridflow.workers.sharding import full_weights, weight_state
from hybridflow.workers.weight_link import LinkAddress, WeightLink, bits_sum, placed
from hybridflow.workers.weight_shards import (
    map_shared_segments,
    plan_buckets,
    shard_buckets,
    share_segments,
)
from hybridflow.workers.weight_sync import load_in_place

RANKS = 3
BUCKET = 64 * 1024


def _model(path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.tiny_head = nn.Linear(4, 2)  # 2 rows over 3 ranks: the last rank holds none
    model.odd_head = nn.Linear(3, 2)  # parts of 12 and 4 bytes: not whole words
    return model


def _actor_rank(rank, link_port, actor_port, path, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{actor_port}", rank=rank, world_size=RANKS)
    model = _model(path)
    mesh = init_device_mesh("cpu", (RANKS,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if rank == 0:
        address = LinkAddress("127.0.0.1", link_port, 2, "gloo")
        link = WeightLink(
            address, 0, torch.device("cpu"), BUCKET, 2**20, timeout_s=60, on_segments=share_segments
        )
        segments = link.segments
    else:
        segments = map_shared_segments()
    sizes = []  # what crosses the actor's group while the buckets fill
    for name in ("all_gather", "gather", "broadcast", "all_reduce"):
        setattr(dist, name, _sized(getattr(dist, name), sizes))
    buckets = shard_buckets(weight_state(model, tied_once=True), segments, BUCKET)
    stats = link.send_buckets(buckets).as_dict() if rank == 0 else sum(1 for _ in buckets)
    filled = list(sizes)
    whole = dict(full_weights(model, tied_once=True))
    torch.save({"stats": stats, "sizes": filled, "whole": whole}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _sized(function, sizes):
    def sized(*args, **kwargs):
        sizes.extend(t.numel() * t.element_size() for t in _tensors(args))
        return function(*args, **kwargs)

    return sized


def _tensors(args):
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, list):
            yield from _tensors(arg)


def _receiver(link_port, path, out):
    model = AutoModelForCausalLM.from_pretrained(path)
    model.tiny_head, model.odd_head = nn.Linear(4, 2), nn.Linear(3, 2)
    address = LinkAddress("127.0.0.1", link_port, 2, "gloo")
    link = WeightLink(address, 1, torch.device("cpu"), BUCKET, timeout_s=60)
    state, expected = model.state_dict(), []

    def load(named, checksum):
        expected.append(checksum)
        load_in_place(state, named, 1, "rollout worker rank 0", checksum)

    stats = link.receive(load).as_dict()
    torch.save({"stats": stats, "weights": model.state_dict(), "checksums": expected}, f"{out}/receiver.pt")


def _process(index, link_port, actor_port, path, out):
    torch.set_num_threads(1)
    if index < RANKS:
        _actor_rank(index, link_port, actor_port, path, out)
    else:
        _receiver(link_port, path, out)


def _ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_every_rank_fills_the_shared_buckets_with_its_own_shards(tiny_model_path, tmp_path):
    link_port, actor_port = _ports(2)
    # from a fork server: a test process that has run Ray must not fork
    mp.start_processes(
        _process,
        args=(link_port, actor_port, tiny_model_path, str(tmp_path)),
        nprocs=RANKS + 1,
        start_method="forkserver",
    )
    sender, *others = [torch.load(tmp_path / f"{r}.pt") for r in range(RANKS)]
    receiver = torch.load(tmp_path / "receiver.pt")
    whole = sender["whole"]
    assert "lm_head.weight" not in whole and len(whole) > 20  # tied: the embedding travels once
    for name, tensor in whole.items():
        assert torch.equal(receiver["weights"][name], tensor), name
    assert torch.equal(receiver["weights"]["lm_head.weight"], whole["model.embed_tokens.weight"])
    sent_bytes = sum(t.numel() * t.element_size() for t in whole.values())
    assert sender["stats"]["bytes"] == receiver["stats"]["bytes"] == sent_bytes
    planned = plan_buckets(list(whole.items()), BUCKET)
    assert sender["stats"]["buckets"] == receiver["stats"]["buckets"] == len(planned) > 3
    assert others[0]["stats"] == others[1]["stats"] == 0  # the other ranks yield no bucket
    # the checksums the trainer sent are the whole tensors' own, bucket by bucket
    assert receiver["checksums"] == [placed(bits_sum(t) for _, t in bucket) for bucket in planned]
    # nothing larger than a bucket's checksums (8 bytes a tensor) crossed the actor's group while they filled
    for rank in (sender, *others):
        assert rank["sizes"] and max(rank["sizes"]) <= 8 * max(len(b) for b in planned), rank["sizes"]
