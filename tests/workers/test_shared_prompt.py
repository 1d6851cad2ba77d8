"""One forward per shared run of tokens (prefix-tree packing) is an exact rewrite: same log-probs, values and
gradients as row by row; token-budget micro-batches give the same update as fixed-size ones."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from hybridflow import DataProto
from hybridflow.config.schema import OptimConfig
from hybridflow.workers.engine import TrainingEngine
from hybridflow.workers.modeling import response_log_probs, response_outputs, response_values
from hybridflow.workers.packing import MicroBatching, batched, pack_prefix_tree, prompt_groups
from hybridflow.workers.row_layouts import trimmed


def grouped_batch(
    group_sizes, prompt_lens, vocab=1000, prompt_width=12, length=7, seed=0, head=0
) -> DataProto:
    """Left-padded prompts of the given real lengths (the first ``head`` tokens the same in all, as a system
    prompt), each repeated for its group; right-padded responses of random lengths (one empty, one full) laid
    out as the rollout lays them out."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randint(3, vocab, (head,), generator=gen)
    rows = []
    for size, plen in zip(group_sizes, prompt_lens):
        prompt = torch.cat([common, torch.randint(3, vocab, (plen - head,), generator=gen)])
        for _ in range(size):
            rlen = int(torch.randint(0, length + 1, (1,), generator=gen))
            rows.append((prompt, torch.randint(3, vocab, (rlen,), generator=gen)))
    rows[1] = (rows[1][0], torch.randint(3, vocab, (length,), generator=gen))
    return layout(rows, prompt_width, length)


def layout(rows, prompt_width, length) -> DataProto:
    """``(prompt ids, response ids)`` pairs as the rollout lays them out."""
    bs, total = len(rows), prompt_width + length
    ids, mask = torch.zeros(bs, total, dtype=torch.long), torch.zeros(bs, total, dtype=torch.long)
    for r, (prompt, response) in enumerate(rows):
        ids[r, prompt_width - len(prompt) : prompt_width] = prompt
        ids[r, prompt_width : prompt_width + len(response)] = response
        mask[r, prompt_width - len(prompt) : prompt_width + len(response)] = 1
    prompt_pos = (mask[:, :prompt_width].cumsum(-1) - 1).clamp(min=0)
    pos = torch.cat([prompt_pos, prompt_pos[:, -1:] + torch.arange(1, length + 1)], dim=1)
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": pos,
            "responses": ids[:, prompt_width:],
            "response_mask": mask[:, prompt_width:],
        }
    )


GROUPS = ([1, 2, 5, 1], [5, 9, 3, 12])  # n = 1, 2, 5 and a lone row; prompts of different lengths


def test_groups_are_found_by_prompt_content():
    assert prompt_groups(grouped_batch(*GROUPS)) == [(0, 1), (1, 3), (3, 8), (8, 9)]


def test_rows_are_packed_as_a_prefix_tree():
    t = torch.tensor
    rows = [
        (t([5, 6, 7]), t([8, 9])),
        (t([5, 6, 7]), t([8, 4, 2])),
        (t([5, 6, 3]), t([9])),
        (t([6, 7]), t([])),
    ]
    packed = pack_prefix_tree(layout(rows, prompt_width=4, length=3))
    # rows 0 and 1 share 5 6 7 8, row 2 shares 5 6 with them; row 3 starts at another token
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 2, 3, 9, 6, 7]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 4, 5, 2, 3, 0, 1]]
    visible = packed.allowed[0].long()
    assert visible[6].nonzero().flatten().tolist() == [0, 1, 2, 3, 5, 6]  # row 1's last token: its own row
    assert visible[8].nonzero().flatten().tolist() == [0, 1, 7, 8]
    assert visible[10].nonzero().flatten().tolist() == [9, 10]
    # outputs kept: the columns that predict a response token (7, the first 8, 4, and row 2's 3)
    assert packed.keep.tolist() == [2, 3, 5, 7]
    assert packed.rows.tolist() == [0, 0, 0, 0]
    assert packed.cols.tolist() == [[0, 1, 0], [0, 1, 2], [3, 0, 0], [0, 0, 0]]
    assert pack_prefix_tree(layout([(t([5]), t([8])), (t([6]), t([8]))], 2, 1)) is None


def test_packed_rows_are_cut_at_the_width_limit():
    data = grouped_batch(*GROUPS)
    packed = pack_prefix_tree(data, max_width=20)
    assert packed.input_ids.shape[0] > 1
    assert packed.rows.tolist() == sorted(packed.rows.tolist())  # rows fill packed rows in order


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def tiny_lm(request, tiny_model_path):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=request.param)


def _grads(model, data, share, micro):
    model.zero_grad(set_to_none=True)
    for part, _ in MicroBatching(micro, share_prompt=share).split(data):
        log_probs, _ = response_log_probs(model, part, temperature=0.7, share_prompt=share)
        weights = torch.linspace(-1, 1, log_probs.shape[1])
        (log_probs * part.batch["response_mask"] * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "micro,head", [(9, 0), (4, 0), (9, 3)]
)  # 4 rows split the n = 5 group; a shared head
def test_log_probs_and_gradients_match_the_unshared_path(tiny_lm, micro, head):
    data = grouped_batch(*GROUPS, head=head)
    mask = data.batch["response_mask"].bool()
    plain = batched(lambda d: response_log_probs(tiny_lm, d, 0.7, True, share_prompt=False), data, 9)
    shared = batched(lambda d: response_log_probs(tiny_lm, d, 0.7, True, share_prompt=True), data, micro)
    assert mask.sum() > 20 and torch.isfinite(shared[0]).all()
    torch.testing.assert_close(shared[0][mask], plain[0][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared[1][mask], plain[1][mask], atol=1e-5, rtol=0)
    g_plain, g_shared = _grads(tiny_lm, data, False, 9), _grads(tiny_lm, data, True, micro)
    for name, grad in g_plain.items():
        assert grad.abs().max() > 0, name
        assert (g_shared[name] - grad).norm() <= 1e-4 * grad.norm(), name


@pytest.mark.parametrize("share_prompt", [True, False])
def test_padding_after_the_responses_is_not_computed(tiny_lm, share_prompt):
    """The same rows laid out for 7 and for 40 response tokens: the same log-probs and entropies, zero at
    every padding position; only the real response positions reach the output layer's softmax."""
    narrow = grouped_batch(*GROUPS, head=2)
    ids, mask = narrow.batch["input_ids"], narrow.batch["attention_mask"].bool()
    rows = [(i[:12][m[:12]], i[12:][m[12:]]) for i, m in zip(ids, mask)]
    wide = layout(rows, 12, 40)
    assert trimmed(wide).batch["input_ids"].shape == narrow.batch["input_ids"].shape
    logits, real = response_outputs(tiny_lm, wide, share_prompt)
    assert logits.shape[0] == int(narrow.batch["attention_mask"][:, 12:].sum()) == int(real.sum())
    with torch.no_grad():
        ours = response_log_probs(tiny_lm, wide, 0.7, True, share_prompt=share_prompt)
        ref = response_log_probs(tiny_lm, narrow, 0.7, True, share_prompt=share_prompt)
    for got, want in zip(ours, ref):
        assert got.shape == (len(wide), 40) and not got[:, 7:].any() and not got[:, :7][~real[:, :7]].any()
        torch.testing.assert_close(got[:, :7], want, atol=1e-5, rtol=1e-5)


def test_values_match_the_unshared_path(tiny_model_path):
    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model_path, num_labels=1)
    data = grouped_batch(*GROUPS, seed=1)
    mask = data.batch["response_mask"].bool()
    plain, shared = response_values(critic, data, share_prompt=False), response_values(critic, data)
    torch.testing.assert_close(shared[mask], plain[mask], atol=1e-5, rtol=0)
    (shared * mask).sum().backward()
    g_shared = {n: p.grad.clone() for n, p in critic.named_parameters()}
    critic.zero_grad()
    (plain * mask).sum().backward()
    for name, p in critic.named_parameters():
        assert (g_shared[name] - p.grad).norm() <= 1e-4 * p.grad.norm(), name


def test_token_budget_keeps_groups_whole_and_sorts_by_length():
    data = grouped_batch([2, 2, 2, 1], [3, 12, 6, 4], seed=2)
    counts = data.batch["attention_mask"].sum(1)
    batching = MicroBatching(
        0, max_token_len=int(counts[2:4].sum() - counts[3] + data.batch["response_mask"][3].sum())
    )
    parts = batching.indices(data)
    assert sorted(np.concatenate(parts).tolist()) == list(range(7))
    assert [2, 3] in [p.tolist() for p in parts]  # the longest group, alone in its micro-batch
    for p in parts:  # groups are never split (none exceeds the budget here)
        assert all((r ^ 1) in p for r in p.tolist() if r < 6)


def test_an_agreed_count_cuts_exactly_that_many_balanced_micro_batches():
    data = grouped_batch([2, 2, 2, 1], [3, 12, 6, 4], seed=2)  # 4 groups, 7 rows
    costs = data.batch["attention_mask"].sum(1) - torch.tensor([0, 1, 0, 1, 0, 1, 0]) * data.batch[
        "attention_mask"
    ][:, :12].sum(1)  # a group's second row does not pay its prompt again
    batching = MicroBatching(0, max_token_len=int(costs.sum()))
    assert batching.count(data) == 1
    for count in (1, 2, 3, 4):  # groups kept whole: the token sums are balanced over consecutive groups
        parts = batching.indices(data, count)
        assert len(parts) == count and sorted(np.concatenate(parts).tolist()) == list(range(7))
        assert all((r ^ 1) in p for p in parts for r in p.tolist() if r < 6)
    loads = [int(costs[p].sum()) for p in batching.indices(data, 2)]
    group_costs = sorted((int(costs[a:b].sum()) for a, b in prompt_groups(data)), reverse=True)
    assert max(loads) == min(max(sum(group_costs[:c]), sum(group_costs[c:])) for c in (1, 2, 3))
    six = batching.indices(data, 6)  # more micro-batches than groups: groups split, only as far as needed
    assert sorted(len(p) for p in six) == [1, 1, 1, 1, 1, 2]
    nine = batching.indices(data, 9)  # more than rows: two empty fillers at the end
    assert [len(p) for p in nine[7:]] == [0, 0] and all(len(p) == 1 for p in nine[:7])
    assert [real for _, real in batching.split(data, 9)] == [True] * 7 + [False] * 2
    assert len(MicroBatching(3).indices(data, 4)) == 4 and len(MicroBatching(3).indices(data, 4)[3]) == 0
    calls = []

    def forward(d):  # fillers run (a rank keeps in step) but their rows do not come back
        calls.append(len(d))
        return d.batch["input_ids"] * 2

    torch.testing.assert_close(batched(forward, data, batching, count=9), data.batch["input_ids"] * 2)
    assert calls == [1] * 9


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_update_equals_fixed_size_update(tiny_model_path, agg):
    from hybridflow.algorithms import agg_loss

    data = grouped_batch([2, 2, 2, 2], [5, 9, 3, 12], seed=3)
    data.batch["advantages"] = torch.linspace(-1, 1, len(data))[:, None].expand(-1, 7).contiguous()

    def updated(micro):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        engine = TrainingEngine(model, OptimConfig(lr=1e-2, weight_decay=0.0), 1e9, "actor")

        def loss_fn(part):
            log_probs, _ = response_log_probs(model, part)
            return agg_loss(
                -log_probs * part.batch["advantages"], part.batch["response_mask"].float(), agg
            ), {}

        applied = {}  # the gradients as the step takes them (the engine frees them after it)
        engine.optimizer.register_step_pre_hook(
            lambda *_: applied.update({name: p.grad.clone() for name, p in model.named_parameters()})
        )
        engine.train_mini_batch(data, micro, loss_fn, agg)
        return applied

    fixed, budget = updated(MicroBatching(2, share_prompt=False)), updated(MicroBatching(0, max_token_len=25))
    assert len(MicroBatching(0, max_token_len=25).indices(data)) > 2  # really cut differently
    for name, grad in fixed.items():
        assert grad.abs().max() > 0 and (budget[name] - grad).norm() <= 1e-5 * grad.norm(), name


def test_embedded_model_shares_prompts_exactly():
    from hybridflow.models import default_model_path
    from hybridflow.workers.modeling import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_path())
    tokenizer = load_tokenizer(default_model_path())
    encode = lambda text: torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    question, other = encode("Compute 14+27. Reply in the form 14+27=<answer>."), encode("Compute 3+4.")
    rows = [(question, encode("14+27=41")), (question, encode("14+27 = 42, I think")), (other, encode("7"))]
    data = layout(rows, prompt_width=len(question), length=max(len(r) for _, r in rows))
    mask = data.batch["response_mask"].bool()
    grads = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        log_probs, _ = response_log_probs(model, data, share_prompt=share)
        (log_probs * mask).sum().backward()
        grads[share] = (
            log_probs.detach(),
            {
                n: p.grad.clone()
                for n, p in model.named_parameters()
                if n.endswith(("q_proj.weight", "embed_tokens.weight"))
            },
        )
    torch.testing.assert_close(grads[True][0][mask], grads[False][0][mask], atol=1e-5, rtol=0)
    for name, grad in grads[False][1].items():
        assert (grads[True][1][name] - grad).norm() <= 1e-4 * grad.norm(), name


def test_actor_worker_config_switches_give_the_same_log_probs(tiny_model_path, chat_prompts):
    """The worker reads share_prompt_prefix and the token-budget keys; rows come back in their order."""
    from hybridflow.config.schema import PPOConfig
    from hybridflow.single_controller import ClassWithInitArgs, LocalWorkerGroup
    from hybridflow.workers import ActorRolloutRefWorker

    cfg = PPOConfig()
    cfg.actor_rollout_ref.model.path = tiny_model_path
    cfg.actor_rollout_ref.rollout.n = 3
    arr = cfg.resolve().actor_rollout_ref
    group = LocalWorkerGroup(
        ClassWithInitArgs(ActorRolloutRefWorker, arr, role="actor_rollout", response_length=6)
    )
    group.init_model()
    prompts = chat_prompts(
        group.workers[0].tokenizer, ["Compute 1+2.", "Say hello to the world please.", "Hi"]
    )
    batch = group.generate_sequences(prompts)
    results = []
    for share, dynamic in ((False, False), (True, False), (True, True)):
        arr.model.share_prompt_prefix, arr.rollout.log_prob_use_dynamic_bsz = share, dynamic
        arr.rollout.log_prob_max_token_len_per_gpu = 40  # several micro-batches, sorted by length
        results.append(group.compute_log_prob(batch).batch["old_log_probs"])
    mask = batch.batch["response_mask"].bool()
    for other in results[1:]:
        torch.testing.assert_close(other[mask], results[0][mask], atol=1e-5, rtol=0)


def test_the_row_helpers_that_moved_still_import_from_modeling_with_a_warning():
    from hybridflow.workers import row_layouts

    for name in ("trimmed", "row_images", "image_column", "image_inputs"):
        with pytest.warns(
            DeprecationWarning, match=f"modeling.{name} moved to hybridflow.workers.row_layouts"
        ):
            old = getattr(__import__("hybridflow.workers.modeling", fromlist=[name]), name)
        assert old is getattr(row_layouts, name)
