"""Tests' helpers for FSDP2 on gloo ranks that run as processes of their own (started from a fork server: a
test process that has run Ray must not fork): free ports to meet at, and a model sharded over the ranks."""

import socket

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on this machine now (held open together, so none repeats)."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def shard_over_ranks(model: nn.Module, rank: int, port: int, world: int) -> nn.Module:
    """This process joins a gloo group of ``world`` ranks at ``port``, and ``model`` (a Hugging Face causal LM)
    is sharded over them as the actor shards it: each decoder layer a unit, then the rest."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
