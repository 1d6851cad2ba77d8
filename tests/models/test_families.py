"""The conformance matrix, in one process: every family of ``hybridflow.models.families`` (tiny, built from its
own transformers config) through every path hybridflow claims for it, each held against a plain row-by-row
Hugging Face forward (log-probs to 1e-5, gradients to 1e-4 of their norm), and every cell that is not
exact doing what its line of the matrix says (``hybridflow.workers.support``): falling back to an exact path
with one warning, or refused with one line naming the model type and the key. FSDP2 and Ulysses, which need
several processes, are in ``test_families_distributed.py``."""

import logging
from pathlib import Path

import openai
import pytest
import torch
from family_cases import (
    FAMILIES,
    assert_gradients_close,
    family_folder,
    gradients,
    laid_out,
    row_by_row,
    scoring_batch,
)
from transformers import AutoModelForCausalLM

from hybridflow import DataProto
from hybridflow.config.schema import ActorConfig, RolloutConfig, RouterReplayConfig
from hybridflow.models.layers import layer_layout
from hybridflow.models.routing import ROUTED_EXPERTS, routers
from hybridflow.serving.server import PolicyServer
from hybridflow.utils.errors import UserError
from hybridflow.workers.checkpointing import _save_hf_folder
from hybridflow.workers.expert_routing import PolicyRouting, Routing
from hybridflow.workers.modeling import load_tokenizer, response_log_probs
from hybridflow.workers.rollout import HFRollout
from hybridflow.workers.row_layouts import RowLayout, tree_masks
from hybridflow.workers.sharding import apply_lora, full_weights
from hybridflow.workers.support import README_MARKERS, family_matrix, support_line
from hybridflow.workers.ulysses import enable_ulysses

SLIDING = {"mistral", "gemma2", "gemma3_text", "gemma4_text", "gpt_oss"}
RECURRENT = {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
MOE = {"qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_5_moe_text", "qwen3_next"}
# the cells that are not "exact", by family (the vLLM cell is "unchecked" in this environment)
NOT_EXACT = {
    **{f: {"ulysses sequence parallelism": "refused"} for f in SLIDING | RECURRENT},
    **{
        f: {
            "ulysses sequence parallelism": "refused",
            "prefix-tree packing (share_prompt_prefix)": "falls back",
            "padding-free rows (use_remove_padding)": "falls back",
        }
        for f in RECURRENT
    },
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {family: family_folder(root, family) for family in FAMILIES}


def load(folders, family):
    return AutoModelForCausalLM.from_pretrained(folders[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_its_line_of_the_matrix(folders, family):
    line = {cell.path: cell.verdict for cell in support_line(load(folders, family))}
    replay = "router replay (R2, R3), load-balancing loss"
    expected = {path: "exact" for path in line} | {"vllm rollout": "unchecked"}
    expected |= {replay: "exact" if family in MOE else "n/a"} | NOT_EXACT.get(family, {})
    assert line == expected
    assert layer_layout(load(folders, family).config).is_moe == (family in MOE)


@pytest.mark.parametrize("share,flat", [(True, False), (False, False), (False, True), (True, True)])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_scoring_layout_equals_row_by_row(folders, family, share, flat):
    """Prefix trees, padded rows, padding-free rows (and trees under use_remove_padding): the log-probs and
    their gradients of every family, each path as the model's ``RowLayout`` takes it."""
    model = load(folders, family)
    data = scoring_batch()
    mask = data.batch["response_mask"].bool()
    want = row_by_row(model, data)
    want_grads = gradients(model, (want * data.batch["weights"]).sum())
    rows = RowLayout.of(model, share, flat, "actor_rollout_ref.model")
    got, _ = response_log_probs(
        model, data, share_prompt=rows.share_prompt, remove_padding=rows.remove_padding
    )
    assert mask.sum() > 80
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)
    assert_gradients_close(gradients(model, (got * data.batch["weights"]).sum()), want_grads, family)


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_a_window_matters_at_these_lengths(folders, family):
    """The check above can fail: the same prefix tree with every layer's mask full (no window) is far off."""
    from hybridflow.workers.packing import pack_prefix_tree

    model = load(folders, family)
    data = scoring_batch()
    packed = pack_prefix_tree(data)
    layout = layer_layout(model.config)
    unwindowed = tree_masks(packed, layout, torch.float32)
    full = packed.attention_mask(torch.float32)
    with torch.no_grad():
        windowed = model(
            input_ids=packed.input_ids, attention_mask=unwindowed, position_ids=packed.position_ids
        )
        no_window = model(input_ids=packed.input_ids, attention_mask=full, position_ids=packed.position_ids)
    assert (windowed.logits - no_window.logits).abs().max() > 1e-2


def generate(model, folder, prompts, n=3, record=False, length=20):
    """``n`` samples of each prompt (left-padded), rows ending early: a fifth of the vocabulary ends them."""
    tokenizer = load_tokenizer(folder)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, prompt in enumerate(prompts):
        ids[r, width - len(prompt) :], mask[r, width - len(prompt) :] = prompt, 1
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(700, 900)]
    config = RolloutConfig(n=n, temperature=1.0, top_k=0, top_p=1.0)
    rollout = HFRollout(model, tokenizer, config, length, seed=3, record_routing=record)
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
    return rollout.generate_sequences(DataProto.from_dict(batch))


def prompts(same_length: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    head = torch.randint(5, 700, (7,), generator=gen)
    return [
        torch.cat([head, torch.randint(5, 700, (9 if same_length else k,), generator=gen)])
        for k in (12, 4, 9)
    ]


@pytest.mark.parametrize("same_length", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_rollouts_log_probs_equal_row_by_row(folders, family, same_length):
    """n > 1 samples forked from each prompt's cache, rows that end at different steps leaving it, left
    padding, and the prompts' shared prefix run once (prompts of one length: every family shares it)."""
    model = load(folders, family).eval()
    out = generate(model, folders[family], prompts(same_length))
    mask = out.batch["response_mask"].bool()
    lengths = mask.sum(dim=1)
    assert len(set(lengths.tolist())) > 2, lengths  # rows ended at different steps
    with torch.no_grad():
        want = row_by_row(model, out)
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], want[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_reload_gives_the_same_model(folders, family, tmp_path):
    """A checkpoint's Hugging Face folder (as the actor writes it) reloads with the same outputs."""
    model = load(folders, family)
    _save_hf_folder(tmp_path / "hf", model, 0)
    data = scoring_batch(seed=1)
    with torch.no_grad():
        assert torch.equal(
            row_by_row(AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), data), row_by_row(model, data)
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapters_score_exactly_and_save_merged(folders, family, tmp_path):
    """A LoRA policy (adapters on every linear layer, and on an MoE model's experts and router, which peft
    targets too; all drawn nonzero) packed against row by row; its merged Hugging Face folder, as a
    checkpoint writes it, holds every weight with its adapter merged in (up to the rounding of merging)."""
    model = apply_lora(load(folders, family), 4, 8, ["all-linear"])
    torch.manual_seed(0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.normal_(0, 0.1)
    data = scoring_batch(seed=1)
    mask = data.batch["response_mask"].bool()
    with torch.no_grad():
        want = row_by_row(model, data)
        got, _ = response_log_probs(model, data)
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)
    _save_hf_folder(tmp_path / "hf", model, 0)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    merged = dict(full_weights(model))
    assert {
        name: tensor for name, tensor in reloaded.state_dict().items() if name in merged
    }.keys() == merged.keys()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, merged[name]), name
    with torch.no_grad():
        torch.testing.assert_close(row_by_row(reloaded, data)[mask], want[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_served_log_probs_equal_row_by_row(folders, family):
    """``hybridflow serve``'s engine over the family: the log-prob of each sampled token, as the ``openai``
    client reads it from a chat call (with vLLM's ``return_token_ids``), is the model's own."""
    model = load(folders, family).eval()
    tokenizer = load_tokenizer(folders[family])
    rollout = HFRollout(model, tokenizer, RolloutConfig(), 8, seed=0)
    server = PolicyServer(rollout, tokenizer, "tiny", max_tokens_limit=8, window_s=0.0)
    client = openai.OpenAI(base_url=server.start_in_thread(), api_key="none")
    try:
        answer = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Compute 12+7. Reply in the form 12+7=<answer>."}],
            max_tokens=8,
            temperature=1.0,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
    finally:
        server.stop_thread()
    prompt, sampled = answer.model_extra["prompt_token_ids"], answer.choices[0].model_extra["token_ids"]
    served = torch.tensor([entry.logprob for entry in answer.choices[0].logprobs.content])
    row = laid_out([(torch.tensor(prompt), torch.tensor(sampled))], len(prompt), len(sampled))
    assert len(sampled) == len(served) > 0
    with torch.no_grad():
        torch.testing.assert_close(served, row_by_row(model, row)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(MOE))
def test_router_replay_uses_the_rollouts_choices(folders, family):
    """R3: the rollout records each token's experts; after the routers drift (as another engine's kernels
    would), the trainer's forwards, in every layout, route every recorded token as the rollout did, where
    its own routing would often have differed."""
    model = load(folders, family).eval()
    out = generate(model, folders[family], prompts(False), record=True)
    recorded = out.batch[ROUTED_EXPERTS]
    known = (recorded >= 0).all(dim=-1).all(dim=-1)
    assert known.sum() == out.batch["attention_mask"].sum() - len(out)  # all but each row's last token
    torch.manual_seed(0)
    with torch.no_grad():
        for router in routers(model):
            router.weight.add_(torch.randn_like(router.weight) * 0.05)
    experts = layer_layout(model.config).experts
    for share, flat in [(True, False), (False, False), (False, True)]:
        replayed, own = Routing(experts, replay=recorded), Routing(experts)
        with torch.no_grad():
            response_log_probs(model, out, share_prompt=share, remove_padding=flat, routing=replayed)
            response_log_probs(model, out, share_prompt=share, remove_padding=flat, routing=own)
        assert torch.equal(replayed.chosen[known], recorded[known]), (share, flat)
        assert replayed.differed > 0.02 and not torch.equal(own.chosen[known], recorded[known])


@pytest.mark.parametrize("family", sorted(SLIDING | RECURRENT))
def test_sequence_parallelism_is_refused_in_one_line(folders, family):
    key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    model = load(folders, family)
    kind = layer_layout(model.config).model_type
    with pytest.raises(UserError, match=rf"^{key}=2: {kind} has [^\n]+; use {key}=1 for this model$"):
        enable_ulysses(model, 2, key)


@pytest.mark.parametrize("family", sorted(RECURRENT))
def test_padding_free_rows_of_recurrent_layers_fall_back_with_one_warning(folders, family, caplog):
    model = load(folders, family)
    with caplog.at_level(logging.WARNING):
        rows = RowLayout.of(model, True, True, "actor_rollout_ref.model")
    assert rows == RowLayout(share_prompt=False, remove_padding=False)
    (record,) = caplog.records
    assert record.getMessage().startswith(
        f"actor_rollout_ref.model.use_remove_padding: {family} has linear_attention layers"
    )


def test_routing_keys_say_what_they_do_on_each_model(folders, caplog):
    """R3 needs a rollout that records routing (one line when it does not), and on a dense model the
    routing keys say in one warning that they do nothing."""
    r3 = ActorConfig(router_replay=RouterReplayConfig(mode="R3"))
    moe = layer_layout(load(folders, "qwen3_moe").config)
    with pytest.raises(UserError, match=r"router_replay.mode=R3 replays the rollout's expert choices"):
        PolicyRouting(r3, moe, records=False, sequence_parallel=False)
    with caplog.at_level(logging.WARNING):
        PolicyRouting(r3, layer_layout(load(folders, "llama").config), records=True, sequence_parallel=False)
    assert [r.getMessage() for r in caplog.records] == [
        "actor_rollout_ref.actor.router_replay.mode=R3: llama has no routed experts; it does nothing"
    ]


def test_the_readme_table_is_the_matrix():
    """The README's family table is generated (``scripts/support_matrix.py --write``), never edited by hand."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    begin, end = README_MARKERS
    assert readme.split(begin, 1)[1].split(end, 1)[0].strip() == family_matrix(), (
        "README.md's family table is stale: run `.venv/bin/python scripts/support_matrix.py --write`"
    )


@pytest.mark.parametrize("family,reads_positions", [("llama", True), ("qwen3_moe", True), ("gpt_oss", False)])
def test_rows_end_to_end_by_their_positions_are_exact_only_where_the_model_reads_them(
    folders, family, reads_positions
):
    """Flash attention's padding-free layout (``flatten_rows``: no mask, positions from 0 per row, from which
    transformers finds where rows begin) on eager/SDPA models: exact for models whose mask code reads row
    boundaries from the positions (Llama's, Qwen's), far off for gpt-oss's, which does not. Hence eager and
    SDPA models are padding-free under block masks of their own (the tree without sharing) instead."""
    from hybridflow.workers.packing import flatten_rows

    model = load(folders, family).eval()
    data = scoring_batch()
    mask = data.batch["response_mask"].bool()
    flat = flatten_rows(data)
    with torch.no_grad():
        logits = model(input_ids=flat.input_ids, position_ids=flat.position_ids, use_cache=False).logits[0]
        got = (
            logits[flat.keep].float().log_softmax(-1).gather(1, data.batch["responses"][mask][:, None])[:, 0]
        )
        want = row_by_row(model, data)[mask]
    assert torch.allclose(got, want, atol=1e-5, rtol=0) == reads_positions, (got - want).abs().max()
