"""``weight_shards``: a 3-rank FSDP2 actor fills the weight link's shared-memory buckets with its own shards,
each rank in place, and a rollout process receives the whole model bit for bit, checked against the
trainer's checksum, while nothing larger than the checksums crosses the actor's group. Over 3 ranks most
tensors' rows do not divide evenly, a 2-row tensor leaves a rank empty, and some tensors' parts are not
whole 8-byte words (their checksum is read back whole). Into the two bucket segments, or into the model
segment: the receiver's model then holds that memory, and the second sync writes straight into it."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fsdp_gloo import free_ports, shard_over_ranks
from torch import nn
from transformers import AutoModelForCausalLM

from hybridflow.workers.sharding import full_weights, weight_state
from hybridflow.workers.weight_link import MODEL_SEGMENT, LinkAddress, WeightLink, bits_sum, placed
from hybridflow.workers.weight_shards import (
    map_shared_segments,
    model_layout,
    plan_buckets,
    shard_buckets,
    share_segments,
)
from hybridflow.workers.weight_sync import adopt, load_in_place

RANKS = 3
BUCKET = 64 * 1024
SYNCS = 2


def _model(path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.tiny_head = nn.Linear(4, 2)  # 2 rows over 3 ranks: the last rank holds none
    model.odd_head = nn.Linear(3, 2)  # parts of 12 and 4 bytes: not whole words
    return model


def _actor_rank(rank, link_port, actor_port, path, out, into_model):
    model = shard_over_ranks(_model(path), rank, actor_port, RANKS)
    plans = plan_buckets(weight_state(model, tied_once=True), BUCKET)
    if rank == 0:
        address = LinkAddress("127.0.0.1", link_port, 2, "gloo")
        link = WeightLink(
            address,
            0,
            torch.device("cpu"),
            BUCKET,
            2**20,
            timeout_s=60,
            on_segments=share_segments,
            model_bytes=model_layout(plans)[-1],
        )
        segments = link.segments
    else:
        segments = map_shared_segments()
    sizes = []  # what crosses the actor's group while the buckets fill
    for name in ("all_gather", "gather", "broadcast", "all_reduce", "barrier"):
        setattr(dist, name, _sized(getattr(dist, name), sizes))
    stats = []
    for sync in range(SYNCS):
        if sync:  # the trainer's next weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        buckets = shard_buckets(weight_state(model, tied_once=True), segments, BUCKET, into_model)
        stats.append(link.send_buckets(buckets).as_dict() if rank == 0 else sum(1 for _ in buckets))
    filled = [s for s in sizes if s is not None]
    whole = dict(full_weights(model, tied_once=True))
    record = {"stats": stats, "sizes": filled, "barriers": sizes.count(None), "whole": whole}
    torch.save(record, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _sized(function, sizes):
    def sized(*args, **kwargs):
        sizes.extend(t.numel() * t.element_size() for t in _tensors(args))
        if function.__name__ == "barrier":
            sizes.append(None)
        return function(*args, **kwargs)

    return sized


def _tensors(args):
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, list):
            yield from _tensors(arg)


def _receiver(link_port, path, out, into_model):
    model = AutoModelForCausalLM.from_pretrained(path)
    model.tiny_head, model.odd_head = nn.Linear(4, 2), nn.Linear(3, 2)
    address = LinkAddress("127.0.0.1", link_port, 2, "gloo")
    link = WeightLink(address, 1, torch.device("cpu"), BUCKET, timeout_s=60)
    expected, stats = [], []

    def load(named, checksum):  # as a lock-step rollout worker loads (``WeightSyncEnds._load_weights``)
        expected.append(checksum)
        if link.place(named[0][1])[0] == MODEL_SEGMENT:
            adopt(model, named)
        load_in_place(model.state_dict(), named, 1, "rollout worker rank 0", checksum)

    for _ in range(SYNCS):
        stats.append(link.receive(load).as_dict())
    weights = model.state_dict()
    places = {name: link.place(tensor) for name, tensor in weights.items()}
    torch.save(
        {"stats": stats, "weights": weights, "checksums": expected, "places": places}, f"{out}/receiver.pt"
    )


def _process(index, link_port, actor_port, path, out, into_model):
    torch.set_num_threads(1)
    if index < RANKS:
        _actor_rank(index, link_port, actor_port, path, out, into_model)
    else:
        _receiver(link_port, path, out, into_model)


@pytest.mark.parametrize("into_model", [False, True], ids=["bucket segments", "model segment"])
def test_every_rank_fills_the_shared_buckets_with_its_own_shards(tiny_model_path, tmp_path, into_model):
    link_port, actor_port = free_ports(2)
    # from a fork server: a test process that has run Ray must not fork
    mp.start_processes(
        _process,
        args=(link_port, actor_port, tiny_model_path, str(tmp_path), into_model),
        nprocs=RANKS + 1,
        start_method="forkserver",
    )
    sender, *others = [torch.load(tmp_path / f"{r}.pt") for r in range(RANKS)]
    receiver = torch.load(tmp_path / "receiver.pt")
    whole = sender["whole"]  # the second sync's weights
    assert "lm_head.weight" not in whole and len(whole) > 20  # tied: the embedding travels once
    for name, tensor in whole.items():
        assert torch.equal(receiver["weights"][name], tensor), name
    assert torch.equal(receiver["weights"]["lm_head.weight"], whole["model.embed_tokens.weight"])
    sent_bytes = sum(t.numel() * t.element_size() for t in whole.values())
    planned = plan_buckets(list(whole.items()), BUCKET)
    for sent, received in zip(sender["stats"], receiver["stats"], strict=True):
        assert sent["bytes"] == received["bytes"] == sent_bytes
        assert sent["buckets"] == received["buckets"] == len(planned) > 3
    assert [r["stats"] for r in others] == [[0] * SYNCS] * 2  # the other ranks yield no bucket
    # the checksums the trainer sent are the whole tensors' own, bucket by bucket (the second sync's last)
    assert receiver["checksums"][-len(planned) :] == [placed(bits_sum(t) for _, t in b) for b in planned]
    # nothing larger than a bucket's checksums (8 bytes a tensor) crossed the actor's group while they filled
    for rank in (sender, *others):
        assert rank["sizes"] and max(rank["sizes"]) <= 8 * max(len(b) for b in planned), rank["sizes"]
    held = {name for name, place in receiver["places"].items() if place and place[0] == MODEL_SEGMENT}
    if into_model:  # every tensor lies in the model segment: its own places, no barrier to wait for
        assert held == set(receiver["weights"]) and others[0]["barriers"] == 0
        assert len({place for place in receiver["places"].values()}) == len(whole)  # tied: one place
    else:  # copied out of the two bucket segments into the model's own memory; a barrier a bucket
        assert not held and others[0]["barriers"] == SYNCS * len(planned)
