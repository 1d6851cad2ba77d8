"""Ulysses sequence parallelism (``hybridflow.workers.ulysses``) on 2 and 4 CPU processes (gloo): log-probs,
entropies and values computed with each sequence split over the group equal the one-process ones to 1e-5, and
the gradients (summed over the group, as the data-parallel reduction sums them) to 1e-4, for packed prefix trees
and plain rows whose widths do not divide by the group size."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_shared_prompt import layout
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from hybridflow.utils.errors import UserError
from hybridflow.workers.modeling import response_log_probs, response_values
from hybridflow.workers.ulysses import (
    causal_mask,
    enable_ulysses,
    left_aligned,
    sequence_parallel,
    split_columns,
)


def batch(gap=False):
    """7 rows: a group of 3 samples of a 13-token prompt, a pair of a 6-token prompt, two lone rows; responses of
    1-9 tokens, so the packed width (and the plain rows' width) divides by neither 2 nor 4. ``gap``: one prompt
    token no other token attends to."""
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, 1000, (n,), generator=gen)  # noqa: E731
    rows = []
    for prompt_len, response_lens in ((13, (9, 4, 7)), (6, (2, 9)), (11, (5,)), (3, (1,))):
        prompt = ids(prompt_len)
        rows += [(prompt, ids(n)) for n in response_lens]
    data = layout(rows, prompt_width=13, length=9)
    if gap:  # the rows are not one run of tokens each: the plain path needs a mask of its own
        data.batch["attention_mask"][5, 4] = 0
    data.batch["weights"] = torch.linspace(-1, 1, 7)[:, None] * torch.linspace(0.5, 1.5, 9)
    return data


# prefix trees; plain rows (moved to their first columns, causal attention without a mask); plain rows one of
# which has a gap (the batch gets a mask of its own)
CASES = ("packed", "plain", "gap")


def run(model, data, share, sp):
    """Log-probs and entropies (with gradients through both), and the gradients of a weighted sum of them."""
    model.zero_grad()
    log_probs, entropy = response_log_probs(
        model, data, 0.7, with_entropy=True, entropy_grad=True, share_prompt=share, sp=sp
    )
    ((log_probs + 0.1 * entropy) * data.batch["weights"]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return log_probs.detach(), entropy.detach(), grads


def critic_run(model, data, share, sp):
    model.zero_grad()
    values = response_values(model, data, share, sp)
    (values * data.batch["weights"]).sum().backward()
    return values.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank(rank, port, path, out):
    """Rank ``rank`` of 4: the results with each sequence over all 4 ranks, then over groups of 2 (ranks 0-1
    and 2-3, each group holding the same batch) with gradient checkpointing on."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    four, two = sequence_parallel(4, key), sequence_parallel(2, key)
    model = AutoModelForCausalLM.from_pretrained(path)
    enable_ulysses(model, 4, key)
    torch.manual_seed(0)  # the critic's fresh value head: the same in every process
    critic = AutoModelForTokenClassification.from_pretrained(path, num_labels=1)
    enable_ulysses(critic, 4, "critic.ulysses_sequence_parallel_size")
    data = batch()
    results = {(4, case): run(model, batch(case == "gap"), case == "packed", four) for case in CASES}
    results["critic"] = critic_run(critic, data, True, four)
    # the module still generates as before (no ulysses keyword: the original attention, its own mask)
    prompt = data.batch["input_ids"][:2, -6:]
    results["generated"] = model.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    results.update({(2, case): run(model, batch(case == "gap"), case == "packed", two) for case in CASES})
    torch.save(results, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model_path, num_labels=1)
    data = batch()
    results = {case: run(model, batch(case == "gap"), case == "packed", None) for case in CASES}
    results["critic"] = critic_run(critic, data, True, None)
    prompt = data.batch["input_ids"][:2, -6:]
    results["generated"] = model.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False
    )
    return results


def test_split_sequences_equal_one_process(tiny_model_path, reference, tmp_path):
    # from a fork server, not forked from this process: a test process that has run Ray must not fork (the
    # children broke its connection to Ray's control service, and the next placement group waited forever)
    mp.start_processes(
        _rank, args=(_free_port(), tiny_model_path, str(tmp_path)), nprocs=4, start_method="forkserver"
    )
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(4)]
    mask = batch().batch["response_mask"].bool()
    for size, case in [(size, case) for size in (4, 2) for case in CASES]:
        log_probs, entropy, grads = reference[case]
        for rank in ranks:  # every rank of a group holds every token's result
            torch.testing.assert_close(rank[size, case][0][mask], log_probs[mask], rtol=0, atol=1e-5)
            torch.testing.assert_close(rank[size, case][1][mask], entropy[mask], rtol=0, atol=1e-5)
        assert len(grads) > 10
        for name, grad in grads.items():
            assert grad.abs().max() > 0, name
            for group in [ranks[i : i + size] for i in range(0, 4, size)]:
                summed = sum(rank[size, case][2][name] for rank in group)
                torch.testing.assert_close(summed, grad, rtol=1e-4, atol=1e-6, msg=f"{size} {case} {name}")
    values, grads = reference["critic"]
    for rank in ranks:
        torch.testing.assert_close(rank["critic"][0][mask], values[mask], rtol=0, atol=1e-5)
        assert torch.equal(rank["generated"], reference["generated"])
    for name, grad in grads.items():
        torch.testing.assert_close(sum(r["critic"][1][name] for r in ranks), grad, rtol=1e-4, atol=1e-6)


def test_columns_are_padded_to_the_group_and_rows_moved_to_their_first_columns():
    class Rank:
        size, rank = 4, 3

    padding = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])  # 10 columns, the first one left padding
    allowed = causal_mask(padding)
    assert allowed[0, 0, 0].tolist() == [True] + [False] * 9  # a padding column only sees itself
    assert allowed[0, 0, 4].tolist() == [False, True, True, True, True] + [False] * 5
    part = split_columns(torch.arange(10)[None], torch.arange(10)[None], allowed, Rank())
    assert (part.start, part.width) == (9, 3) and part.attention_mask.shape == (1, 1, 12, 12)
    assert part.input_ids.tolist() == [[9, 0, 0]]  # the last real column, then two padding columns
    assert part.attention_mask[0, 0, 11].tolist() == [False] * 11 + [True]

    ids, pos = (
        torch.tensor([[0, 0, 5, 6, 7], [8, 9, 4, 0, 0]]),
        torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]),
    )
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    moved = left_aligned(ids, pos, padding)
    assert [t.tolist() for t in moved] == [
        [[5, 6, 7, 0, 0], [8, 9, 4, 0, 0]],
        [[0, 1, 2, 0, 0], [0, 1, 2, 0, 0]],
    ]
    assert left_aligned(ids, pos, torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 0, 0]])) is None  # a gap


def test_heads_that_do_not_divide_are_refused(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)  # 4 heads
    with pytest.raises(UserError, match=r"critic.ulysses_sequence_parallel_size=3: .*4 attention heads"):
        enable_ulysses(model, 3, "critic.ulysses_sequence_parallel_size")


def test_a_vision_language_model_is_refused(tiny_vlm):
    """Under sequence parallelism a batch's images would not follow its columns (nor would Qwen's 3-D
    positions): a VLM is refused naming the key, not trained without its pictures."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm("qwen2_vl"))
    with pytest.raises(
        UserError, match=r"actor_rollout_ref.actor.ulysses_sequence_parallel_size=2: .*vision tower"
    ):
        enable_ulysses(model, 2, "actor_rollout_ref.actor.ulysses_sequence_parallel_size")
