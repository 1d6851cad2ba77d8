"""Prompt data: verl-format datasets, DataProto batching with a resumable loader, demo task generators."""

from hybridflow.data.dataset import RLHFDataset
from hybridflow.data.generation import generation_batch
from hybridflow.data.loader import PromptLoader, collate_fn

__all__ = ["PromptLoader", "RLHFDataset", "collate_fn", "generation_batch"]
