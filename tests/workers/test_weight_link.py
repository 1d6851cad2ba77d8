"""``WeightLink`` (``hybridflow.workers.weight_sync``): the actor's weights stream from one process to two others
over a gloo group of their own, in buckets, and land bit for bit in the receivers' models; a receiver whose
model does not take what arrived stops naming the weight version; checksums tell tensors apart by place."""

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from fsdp_gloo import free_ports
from transformers import AutoModelForCausalLM

from hybridflow.workers import weight_link
from hybridflow.workers.weight_link import (
    LinkAddress,
    WeightLink,
    WeightSyncError,
    checksum,
    copy_summed,
    verify_loaded,
)
from hybridflow.workers.weight_sync import WeightMailbox, load_in_place, policy_weights


def _member(member, address, path, out, broken, shared, tied_once):
    torch.set_num_threads(1)
    link = WeightLink(
        address, member, torch.device("cpu"), 64 * 1024, 2**20, timeout_s=60, shared_memory=shared
    )
    torch.manual_seed(member)
    model = AutoModelForCausalLM.from_pretrained(path)
    if member == 0:  # the trainer's weights: the checkpoint's, changed
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        stats = link.send(policy_weights(model, tied_once=tied_once))
    else:
        state = model.state_dict()

        def load(named, expected):
            if broken and member == 2:  # an engine that ignores what it is given
                named = [(name, tensor + 1) for name, tensor in named]
            load_in_place(state, named, 7, f"rollout worker rank {member - 1}", expected)

        try:
            stats = link.receive(load)
        except WeightSyncError as error:
            torch.save({"error": str(error)}, f"{out}/{member}.pt")
            return
    record = {"stats": stats.as_dict(), "weights": dict(model.state_dict()), "segments": len(link.segments)}
    torch.save(record, f"{out}/{member}.pt")


def _stream(path, out, broken=False, shared=True, tied_once=False):
    (port,) = free_ports(1)
    address = LinkAddress("127.0.0.1", port, 3, "gloo")
    # from a fork server, not forked from this process: a test process that has run Ray must not fork (the
    # children broke its connection to Ray's control service, and the next placement group waited forever)
    mp.start_processes(
        _member,
        args=(address, path, str(out), broken, shared, tied_once),
        nprocs=3,
        start_method="forkserver",
    )
    return [torch.load(out / f"{m}.pt") for m in range(3)]


@pytest.mark.parametrize("shared", [True, False], ids=["shared memory", "over gloo"])
def test_weights_stream_in_buckets_to_every_receiver(tiny_model_path, tmp_path, shared):
    sender, *receivers = _stream(tiny_model_path, tmp_path, shared=shared)
    sent = sender["weights"]
    assert sender["segments"] == (
        2 if shared else 0
    )  # all three on one machine: shared memory, unless told not
    assert not list(Path("/dev/shm").glob("hybridflow-weights-*"))  # unlinked once every member mapped them
    assert sender["stats"]["buckets"] > 3  # 64 KiB buckets: the tiny model's ~1 MB goes in several
    assert sender["stats"]["bytes"] == sum(t.numel() * t.element_size() for t in sent.values())
    for receiver in receivers:
        assert receiver["stats"]["buckets"] == sender["stats"]["buckets"]
        for name, tensor in sent.items():
            assert torch.equal(receiver["weights"][name], tensor), name


def test_a_tied_tensor_travels_once_and_reaches_every_name_it_has(tiny_model_path, tmp_path):
    sender, *receivers = _stream(tiny_model_path, tmp_path, tied_once=True)
    sent = sender["weights"]
    assert sent["lm_head.weight"].data_ptr() == sent["model.embed_tokens.weight"].data_ptr()  # tied
    unique = sum(t.numel() * t.element_size() for name, t in sent.items() if name != "lm_head.weight")
    assert sender["stats"]["bytes"] == unique  # the embedding once
    for receiver in receivers:
        for name, tensor in sent.items():
            assert torch.equal(receiver["weights"][name], tensor), name


def test_a_receiver_that_does_not_hold_what_arrived_stops_naming_the_version(tiny_model_path, tmp_path):
    _, good, broken = _stream(tiny_model_path, tmp_path, broken=True)
    assert "error" not in good
    assert broken["error"].startswith(
        "rollout worker rank 1: after loading weight version 7 its model does not hold the weights the trainer sent"
    )


def test_checksums_see_values_and_places():
    a, b = torch.arange(6.0).view(2, 3), torch.ones(4)
    assert checksum([a, b]) == checksum([a.clone(), b.clone()])
    assert checksum([a, b]) != checksum([b, a])  # the same tensors under each other's names
    assert checksum([a]) != checksum([a + 1e-7])  # one bit off
    assert checksum([a.bfloat16()]) == checksum([a.bfloat16()])
    odd = torch.arange(
        7.0
    )  # a view that starts mid-word, and one of odd length: the values decide, not the layout
    assert checksum([odd[1:]]) == checksum([odd[1:].clone()]) and checksum([odd]) == checksum([odd.clone()])
    with pytest.raises(WeightSyncError, match="after loading weight version 3"):
        verify_loaded(checksum([a]), checksum([a + 1]), 3, "rollout worker rank 0")


def test_a_copy_read_back_chunk_by_chunk_sums_as_the_whole(monkeypatch):
    """``copy_summed`` copies and returns the copy's ``checksum`` term, whatever the chunking: sums that wrap
    past 64 bits, a tensor that ends mid-chunk, a target that starts mid-word, another dtype, an odd length."""
    monkeypatch.setattr(weight_link, "CHUNK_BYTES", 64)  # 8 words a chunk: a 100-word tensor takes 13
    big = torch.full((100,), 2**62, dtype=torch.int64)  # 100 * 2**62 wraps around 2**64 many times
    cases = [
        (torch.empty(100, dtype=torch.int64), big),
        (torch.empty(3, 5), torch.randn(3, 5)),  # 60 bytes: no whole number of words
        (torch.empty(33)[1:], torch.randn(32)),  # starts mid-word
        (torch.empty(40, dtype=torch.float64), torch.randn(40)),  # converted while copied
        (torch.empty(64, dtype=torch.bfloat16), torch.randn(64).bfloat16()),
    ]
    for target, source in cases:
        expected = checksum([source.to(target.dtype)])
        assert copy_summed(target, source) == expected and torch.equal(target, source.to(target.dtype))
    assert copy_summed(torch.empty(100, dtype=torch.int64), big) == int(big.sum())  # torch's own wrap


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora adapters", "full weights in place"])
def test_a_sharded_actor_reaches_a_rollout_worker_of_its_own(tiny_model_path, ray_session, lora_rank):
    """Ray: the actor on 2 FSDP2 ranks, a rollout worker of its own (the hf engine, which takes adapters). With
    LoRA only the adapters travel, gathered from the shards; without, each rank writes its own shards into
    the link's shared-memory buckets. Either way the rollout's (merged) model then equals the actor's, loaded
    in place (lock-step: without LoRA straight into the rollout's model, which holds the link's model segment)
    or kept and taken as a version (asynchronous)."""
    from test_fsdp2 import ShardProbe

    from hybridflow.config.schema import PPOConfig
    from hybridflow.single_controller import ClassWithInitArgs
    from hybridflow.single_controller.ray import RayResourcePool, RayWorkerGroup
    from hybridflow.trainer.weight_transport import LinkedWeights

    cfg = PPOConfig()
    arr = cfg.actor_rollout_ref
    arr.model.path, arr.model.lora_rank, arr.actor.strategy = tiny_model_path, lora_rank, "fsdp2"
    arr.actor.optim.lr = 1e-2
    arr = cfg.resolve().actor_rollout_ref
    pools = [RayResourcePool([n], cpus_per_process=0.5, name=f"link{n}") for n in (2, 1)]
    actor = RayWorkerGroup(
        pools[0], ClassWithInitArgs(ShardProbe, arr, role="actor"), name_prefix="link_actor"
    )
    rollout = RayWorkerGroup(
        pools[1], ClassWithInitArgs(ShardProbe, arr, role="rollout"), name_prefix="link_rollout"
    )
    try:
        actor.init_model()
        rollout.init_model()
        link = LinkedWeights(actor, rollout)
        actor.perturb_adapters()
        stats = link.send(version=1, staged=False)
        first = actor.weights()[0]
        assert_same(rollout.weights()[0], first)
        assert actor.fills_in_place() == [not lora_rank] * 2
        # the full weights went straight into the rollout's model, which holds the link's model segment now
        assert rollout.held_by_the_link() == [not lora_rank]
        whole_bytes = sum(t.numel() * 4 for name, t in first.items() if name != "lm_head.weight")  # tied
        if lora_rank:
            adapter_bytes = actor.adapter_bytes()[0]
            assert stats["weight_sync/mb"] * 2**20 == adapter_bytes < whole_bytes / 10
        else:
            assert stats["weight_sync/mb"] * 2**20 == whole_bytes
        actor.perturb_adapters()
        link.send(version=2, staged=True)  # kept, not loaded: the rollout still holds version 1
        assert_same(rollout.weights()[0], first)
        rollout.use_version(2)
        assert_same(rollout.weights()[0], actor.weights()[0])
        assert rollout.held_by_the_link() == [not lora_rank]  # a kept version is copied into it
    finally:
        for group in (actor, rollout):
            group.shutdown()
        for pool in pools:
            pool.remove()


def assert_same(got, want):
    assert got.keys() == want.keys() and len(want) > 10
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-6, msg=name)


def test_a_forgotten_version_is_the_spare_the_next_one_is_received_into():
    """``WeightMailbox``: once a receiver asks for spares, a version ``use`` forgets is handed out as the
    memory the next version is copied into, never the version being loaded, and none is held for nobody."""
    loaded = []
    mailbox = WeightMailbox(lambda named, version: loaded.append(version))
    versions = {v: [("w", torch.full((3,), float(v))), ("b", torch.zeros(2))] for v in (1, 2, 3)}
    mailbox.post(1, versions[1])
    mailbox.post(2, versions[2])
    mailbox.use(2, keep_from=2)
    assert mailbox.take_spare() == {}  # nobody asked before: version 1 went
    mailbox.post(3, versions[3])
    mailbox.use(3, keep_from=3)
    spare = mailbox.take_spare()
    assert spare.keys() == {"w", "b"} and spare["w"] is versions[2][0][1]  # version 2's own memory
    assert mailbox.take_spare() == {}  # handed out once
    mailbox.post(4, versions[1])
    mailbox.use(4, keep_from=5)  # the version being loaded is never the spare
    assert loaded == [2, 3, 4] and mailbox.take_spare()["w"] is versions[3][0][1]


def test_shared_memory_takes_only_the_segments_it_has_room_for(caplog):
    """A tmpfs fills as it is written: a segment larger than what is left would kill its writer mid-sync, so
    the link drops the model segment first (lock-step syncs copy out of the buckets), then the buckets (they
    travel over the group), and says so in one line."""
    mb = 2**20
    wanted = [64 * mb, 64 * mb, 512 * mb]  # two buckets, then the model
    assert weight_link._fitting(wanted, 640 * mb) == wanted and not caplog.records
    assert weight_link._fitting(wanted, 639 * mb) == wanted[:2]
    assert weight_link._fitting(wanted, 127 * mb) == []
    assert weight_link._fitting(wanted[:2], 128 * mb) == wanted[:2]
    tail = "; a larger /dev/shm (docker: --shm-size) makes syncs faster"
    assert [r.getMessage() for r in caplog.records] == [
        "weight link: 639 MB free in /dev/shm where its segments want 640 MB: the weights copy out of two "
        "buckets" + tail,
        "weight link: 127 MB free in /dev/shm where its segments want 640 MB: the weights travel over the "
        "group (slower)" + tail,
    ]
