"""Prompt data: verl-format datasets (images included: ``images.py``), DataProto batching with a resumable
loader, demo task generators (the visual one: ``visual_task.py``).

May import: ``utils``, ``protocol``, ``models``, ``algorithms``, ``config``, and the rooms of the tier before it
(``rewards``: the offline task data judges the model's own samples with the rule scorers).
"""

from hybridflow.data.dataset import RLHFDataset
from hybridflow.data.generation import generation_batch
from hybridflow.data.loader import PromptLoader, collate_fn

__all__ = ["PromptLoader", "RLHFDataset", "collate_fn", "generation_batch"]
