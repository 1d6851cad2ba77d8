"""The conformance matrix's cells that need several processes, for every family at once on 2 gloo ranks (one
process group, the families one after another): FSDP2 sharding (as the actor shards: each decoder layer a
unit) gives the one-process log-probs and gradients, packed and padding-free; Ulysses sequence parallelism
(each sequence split over both ranks) gives them for every family it accepts, and the others are refused."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from family_cases import FAMILIES, assert_gradients_close, family_folder, gradients, scoring_batch
from transformers import AutoModelForCausalLM

from hybridflow.utils.errors import UserError
from hybridflow.workers.modeling import response_log_probs
from hybridflow.workers.row_layouts import RowLayout
from hybridflow.workers.sharding import full_weights
from hybridflow.workers.ulysses import enable_ulysses, sequence_parallel

KEY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
LAYOUTS = [(True, False), (False, True)]  # prefix trees; padding-free rows (each as the model takes it)


def scored(model, share, flat, sp=None):
    """Log-probs (with gradients) of the family batch, and the gradients of its weighted sum."""
    data = scoring_batch()
    rows = RowLayout.of(model, share, flat, "actor_rollout_ref.model")
    model.zero_grad(set_to_none=True)  # before the forward, as a training step does (FSDP2 keeps its root's)
    log_probs, _ = response_log_probs(
        model, data, share_prompt=rows.share_prompt, remove_padding=rows.remove_padding, sp=sp
    )
    return log_probs.detach(), gradients(model, (log_probs * data.batch["weights"]).sum())


def _fsdp2(folder: str, mesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = AutoModelForCausalLM.from_pretrained(folder)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    results = {}
    for share, flat in LAYOUTS:
        log_probs, grads = scored(model, share, flat)
        whole = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
        results[share, flat] = log_probs, whole
    results["weights"] = {n: t.clone() for n, t in full_weights(model)}
    return results


def _ulysses(folder: str) -> dict | str:
    model = AutoModelForCausalLM.from_pretrained(folder)
    try:
        enable_ulysses(model, 2, KEY)
    except UserError as refused:
        return str(refused)
    sp = sequence_parallel(2, KEY)
    return {layout: scored(model, *layout, sp=sp) for layout in LAYOUTS}


def _rank(rank: int, port: int, folders: dict[str, str], out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    results = {
        family: {"fsdp2": _fsdp2(folder, mesh), "ulysses": _ulysses(folder)}
        for family, folder in folders.items()
    }
    torch.save(results, f"{out}/{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[dict[str, str], list[dict]]:
    root = tmp_path_factory.mktemp("families")
    folders = {family: family_folder(root, family) for family in FAMILIES}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # from a fork server, not forked from this process (a test process that has run Ray must not fork)
    mp.start_processes(_rank, args=(port, folders, str(root)), nprocs=2, start_method="forkserver")
    return folders, [torch.load(root / f"{r}.pt", weights_only=False) for r in range(2)]


def reference(folder: str) -> dict:
    model = AutoModelForCausalLM.from_pretrained(folder)
    return {layout: scored(model, *layout) for layout in LAYOUTS}


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_on_two_ranks_equals_one_process(ranks, family):
    folders, results = ranks
    want = reference(folders[family])
    mask = scoring_batch().batch["response_mask"].bool()
    for layout in LAYOUTS:
        for rank in results:
            log_probs, grads = rank[family]["fsdp2"][layout]
            torch.testing.assert_close(log_probs[mask], want[layout][0][mask], atol=1e-5, rtol=0)
            assert_gradients_close(grads, want[layout][1], f"{family} {layout}")
    model = AutoModelForCausalLM.from_pretrained(folders[family])
    gathered = results[0][family]["fsdp2"]["weights"]
    assert gathered.keys() == model.state_dict().keys()
    assert all(torch.equal(gathered[n], t) for n, t in model.state_dict().items())


@pytest.mark.parametrize("family", FAMILIES)
def test_ulysses_on_two_ranks_equals_one_process_or_is_refused(ranks, family):
    folders, results = ranks
    refused = family in {"mistral", "gemma2", "gemma3_text", "gemma4_text", "gpt_oss"} | {
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "qwen3_next",
    }
    if refused:
        for rank in results:
            assert rank[family]["ulysses"].startswith(f"{KEY}=2: {family} has ")
        return
    want = reference(folders[family])
    mask = scoring_batch().batch["response_mask"].bool()
    for layout in LAYOUTS:
        log_probs = [rank[family]["ulysses"][layout][0] for rank in results]
        for got in log_probs:  # every rank of the group holds every token's result
            torch.testing.assert_close(got[mask], want[layout][0][mask], atol=1e-5, rtol=0)
        summed = {n: sum(rank[family]["ulysses"][layout][1][n] for rank in results) for n in want[layout][1]}
        assert_gradients_close(summed, want[layout][1], f"{family} {layout}")
