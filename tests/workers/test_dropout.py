"""Dropout is off in every model the workers load for training (the actor, the offline trainers' policy,
the critic), unless ``model.disable_dropout=false``: updates then see the policy that was scored."""

import pytest
import torch

from hybridflow.models import make_tiny_model
from hybridflow.workers.modeling import load_model


@pytest.fixture(scope="module")
def dropout_model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("dropout") / "model", attention_dropout=0.5)


def _logits(model, train: bool) -> torch.Tensor:
    model.train(train)
    torch.manual_seed(0)
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_training_forward_equals_the_scoring_forward_with_dropout_off(dropout_model_path):
    model = load_model(dropout_model_path, torch.device("cpu"), "fp32")
    assert model.config.attention_dropout == 0.5  # the checkpoint's config (saved again) keeps its rate
    assert torch.equal(_logits(model, train=True), _logits(model, train=False))

    kept = load_model(dropout_model_path, torch.device("cpu"), "fp32", disable_dropout=False)
    assert (_logits(kept, train=True) - _logits(kept, train=False)).abs().max() > 1e-3  # dropout was on
