"""``full_weights`` over FSDP2 shards (``hybridflow.workers.gathering``): on 3 gloo ranks, so that most tensors'
rows do not divide evenly, a 2-row tensor leaves a rank empty and a 6-row one is gathered alone as it is, the
gathered weights equal the unsharded model's bit for bit, in its order, to every rank or to rank 0 alone, with
one collective per group of tensors."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fsdp_gloo import free_ports, shard_over_ranks
from torch import nn
from transformers import AutoModelForCausalLM

from hybridflow.workers.sharding import full_weights

WORLD = 3


def _model(path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.tiny_head = nn.Linear(4, 2)  # 2 rows over 3 ranks: the last rank holds none
    model.even_head = nn.Linear(400, 6)  # rows that divide by the ranks: gathered alone, as it is
    return model


def _count(function, calls):
    def counted(*args, **kwargs):
        calls.append(function.__name__)
        return function(*args, **kwargs)

    return counted


def _rank(rank, port, path, out):
    torch.set_num_threads(1)
    model = shard_over_ranks(_model(path), rank, port, WORLD)
    calls = []
    dist.all_gather, dist.gather = _count(dist.all_gather, calls), _count(dist.gather, calls)
    results = {}
    for root in (None, 0):
        for group_bytes in (1024, 2**30):
            calls.clear()
            weights = list(full_weights(model, root=root, group_bytes=group_bytes))
            results[root, group_bytes] = ([n for n, _ in weights], dict(weights), list(calls))
    torch.save(results, f"{out}/{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture
def gathered(tiny_model_path, tmp_path):
    (port,) = free_ports(1)
    # from a fork server: a test process that has run Ray must not fork
    mp.start_processes(
        _rank, args=(port, tiny_model_path, str(tmp_path)), nprocs=WORLD, start_method="forkserver"
    )
    return [torch.load(tmp_path / f"{r}.pt") for r in range(WORLD)]


def _groups(tensors, budget):
    """How many runs of consecutive tensors of at most ``budget`` bytes (a larger tensor alone) they make."""
    count, used = 0, None
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if used is None or used + size > budget:
            count, used = count + 1, size
        else:
            used += size
    return count


def test_sharded_weights_gather_whole_to_every_rank_or_to_one(tiny_model_path, gathered):
    expected = _model(tiny_model_path).state_dict()
    names = list(expected)
    small = _groups(expected.values(), 1024)
    assert 1 < small < len(names)  # some groups of several tensors, some tensors alone
    assert any(t.shape[0] % WORLD for t in expected.values())  # uneven shards are part of the case
    for rank, results in enumerate(gathered):
        for (root, group_bytes), (order, weights, calls) in results.items():
            if root == 0 and rank != 0:
                assert order == [], (rank, group_bytes)  # only rank 0 receives: the others send their shards
            else:
                assert order == names, (rank, root, group_bytes)
                for name in names:
                    assert torch.equal(weights[name], expected[name]), name
            # one collective per group of consecutive tensors: all of them in one when the budget holds them
            assert calls == ["all_gather" if root is None else "gather"] * (
                small if group_bytes == 1024 else 1
            )
