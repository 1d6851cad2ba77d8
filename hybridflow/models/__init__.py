"""Models hybridflow can run without downloads: tiny random test models (text and vision-language) and the
embedded SmolLM2; the vision-language families and what their forward passes take (``vision.py``).

May import: ``utils`` only (it sits in the first tier, beside ``protocol``).
"""

from hybridflow.models.default import default_model_path, resolve_model_path
from hybridflow.models.tiny import make_tiny_model, make_tiny_tokenizer

__all__ = ["default_model_path", "make_tiny_model", "make_tiny_tokenizer", "resolve_model_path"]
