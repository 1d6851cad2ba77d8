"""Random-number state of python, numpy and torch, saved and restored together so a resumed run
draws the same samples as an uninterrupted one."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def get_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU (and every CUDA device's) generator states.

    Holds only ints, lists and tensors, so ``torch.load(..., weights_only=True)`` can read it back.
    """
    legacy = np.random.get_state(legacy=True)  # the global MT19937's: a tuple
    if not isinstance(legacy, tuple):
        raise TypeError(f"numpy's global generator state is a {type(legacy).__name__}, not MT19937's tuple")
    kind, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``get_rng_state`` captured (CUDA states only where CUDA is available)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
