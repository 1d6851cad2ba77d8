"""A partial rollout: new weights reach a generation in flight. The unfinished rows' KV cache is recomputed
under them (the tokens after the update are exactly what the new weights decode from the prefix), and each
token records the version that sampled it."""

import copy

import torch
from transformers import AutoModelForCausalLM

from hybridflow.config import RolloutConfig
from hybridflow.workers.modeling import load_tokenizer
from hybridflow.workers.rollout import HFRollout

LENGTH, SWITCH = 10, 4  # tokens 0-3 come from the old weights, 4-9 from the new


class SwitchOnce:
    """A ``WeightFeed`` that loads ``new`` into ``model`` at its ``at``-th refresh (after token ``at - 1``)."""

    def __init__(self, model: torch.nn.Module, new: dict[str, torch.Tensor], at: int) -> None:
        self.model, self.new, self.at, self.calls, self.version = model, new, at, 0, 0

    def refresh(self) -> bool:
        self.calls += 1
        if self.calls != self.at:
            return False
        self.model.load_state_dict(self.new)
        self.version = 1
        return True


def random_model(path: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():  # large random weights: each prompt gets its own greedy answer
        for weight in model.parameters():
            if weight.dim() > 1:
                weight.normal_(0, 0.2)
    model.generation_config.eos_token_id = None  # no row ends: every row is in flight at the switch
    return model


def greedy(model, ids: torch.Tensor, mask: torch.Tensor, tokens: int) -> torch.Tensor:
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        pad_token_id=0,
    )
    return out[:, ids.shape[1] :]


def test_weights_switched_in_flight_decode_from_a_recomputed_cache(tiny_model_path, chat_prompts):
    old, new = random_model(tiny_model_path, 0), random_model(tiny_model_path, 1)
    tokenizer = load_tokenizer(tiny_model_path)
    prompts = chat_prompts(tokenizer, ["Compute 1+2.", "Say hello to the world please.", "Hi"])
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    module = copy.deepcopy(old)
    rollout = HFRollout(module, tokenizer, RolloutConfig(n=2, do_sample=False), LENGTH)
    rollout.follow_weights(SwitchOnce(module, new.state_dict(), at=SWITCH))
    out = rollout.generate_sequences(prompts)

    head = greedy(old, ids, mask, SWITCH)
    tail = greedy(
        new, torch.cat([ids, head], 1), torch.cat([mask, torch.ones_like(head)], 1), LENGTH - SWITCH
    )
    expected = torch.cat([head, tail], 1).repeat_interleave(2, 0)
    assert out.batch["responses"].tolist() == expected.tolist()
    versions = out.batch["rollout_weight_versions"]
    assert versions.tolist() == [[0] * SWITCH + [1] * (LENGTH - SWITCH)] * 6
    # the new weights alone, from the start, decode otherwise: the switch did happen mid-generation
    assert not torch.equal(greedy(new, ids, mask, LENGTH).repeat_interleave(2, 0), out.batch["responses"])
    assert not torch.equal(greedy(old, ids, mask, LENGTH).repeat_interleave(2, 0), out.batch["responses"])
