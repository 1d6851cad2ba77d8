"""The Hugging Face rollout with images: each prompt's image goes through the vision tower once for its n
samples, the decoding positions (Qwen's 3-D ones) are the model's own, and the rollout's log-probs are the
trainer's; a placeholder token is never sampled."""

import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.config.schema import RolloutConfig
from hybridflow.data.dataset import RLHFDataset
from hybridflow.data.loader import collate_fn
from hybridflow.data.prepare import main as prepare_data
from hybridflow.workers.modeling import load_image_prompts, load_model, response_log_probs
from hybridflow.workers.rollout import HFRollout

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava"]


@pytest.fixture(scope="module")
def shapes_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes")
    prepare_data(["shapes", str(out), "--train-size", "8", "--test-size", "2"])
    return out / "train.parquet"


def image_prompts(folder, shapes_file, rows=3, text_only=False):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dataset = RLHFDataset(shapes_file, tokenizer, 128, processor=load_image_prompts(folder, tokenizer))
    items = [dataset[i] for i in range(rows)]
    if text_only:  # a row of the same dataset without its picture
        items[0]["raw_prompt"] = [{"role": "user", "content": "Which colour?"}]
        items[0]["image_inputs"] = ()
        text = tokenizer.apply_chat_template(
            items[0]["raw_prompt"], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        width = len(items[0]["input_ids"])
        items[0]["input_ids"] = torch.cat([torch.full((width - len(ids),), tokenizer.pad_token_id), ids])
        items[0]["attention_mask"] = (torch.arange(width) >= width - len(ids)).long()
        items[0]["position_ids"] = (items[0]["attention_mask"].cumsum(0) - 1).clamp(min=0)
    return tokenizer, collate_fn(items)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_log_probs_are_the_models_own_and_the_trainers(
    family, tiny_vlm, shapes_file, plain_log_probs
):
    folder = tiny_vlm(family)
    tokenizer, prompts = image_prompts(folder, shapes_file, text_only=True)
    model = load_model(folder, torch.device("cpu"), attn_implementation="sdpa").eval()
    encoded = []
    get_features = model.model.get_image_features
    model.model.get_image_features = lambda pixel_values, *a, **k: (
        encoded.append(len(pixel_values) if family == "llava" else len(a[0] if a else k["image_grid_thw"])),
        get_features(pixel_values, *a, **k),
    )[1]
    config = RolloutConfig(n=4, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    out = HFRollout(model, tokenizer, config, 10, seed=0).generate_sequences(prompts)
    assert sum(encoded) == 2  # two prompts with a picture, four samples each: each picture encoded once
    assert len(out) == 12 and int(out.batch["response_mask"].sum()) > 12
    assert not torch.isin(out.batch["responses"], torch.tensor([model.config.image_token_id])).any()
    mask = out.batch["response_mask"].bool()
    for r, plain in enumerate(plain_log_probs(model, out)):
        got = out.batch["rollout_log_probs"][r][mask[r]]
        assert torch.allclose(got, plain, atol=1e-5), (family, r, (got - plain).abs().max())
    with torch.no_grad():
        trainer, _ = response_log_probs(model, out)
    assert (trainer - out.batch["rollout_log_probs"]).abs().max() < 1e-5


class RecomputeAt:
    """A ``WeightFeed`` whose ``at``-th refresh says new weights came (the same ones): the rollout then
    recomputes the unfinished rows' cache, pictures and 3-D positions included."""

    def __init__(self, at: int) -> None:
        self.at, self.calls, self.version = at, 0, 0

    def refresh(self) -> bool:
        self.calls += 1
        self.version = int(self.calls >= self.at)
        return self.calls == self.at


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_a_cache_recomputed_in_flight_keeps_the_pictures(family, tiny_vlm, shapes_file, plain_log_probs):
    folder = tiny_vlm(family)
    tokenizer, prompts = image_prompts(folder, shapes_file)
    model = load_model(folder, torch.device("cpu"), attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = -1  # no row ends: every row is in flight at the recompute
    engine = HFRollout(
        model, tokenizer, RolloutConfig(n=2, do_sample=True, temperature=1.0, top_k=0), 8, seed=0
    )
    engine.weights = RecomputeAt(3)
    out = engine.generate_sequences(prompts)
    versions = out.batch["rollout_weight_versions"]
    assert (versions[:, :3] == 0).all() and (versions[:, 3:] == 1).all()
    for r, plain in enumerate(plain_log_probs(model, out)):
        assert torch.allclose(out.batch["rollout_log_probs"][r], plain, atol=1e-5), (family, r)
