import random

import numpy as np
import torch

from hybridflow.utils.rng import get_rng_state, set_rng_state


def test_rng_state_round_trip_reproduces_random_numbers(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    torch.save(get_rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))  # plain data: no pickle trust needed
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()) == expected
