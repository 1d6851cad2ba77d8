"""hybridflow: RL post-training of LLMs on the HybridFlow model.

One driver writes the algorithm as plain Python; each call fans out to a worker group and comes back
as one ``DataProto``. ``PPOConfig`` and its section classes (``DataConfig``, ``ActorConfig``...),
``PPOTrainer`` and ``load_trained_actor`` are imported on first use, so ``import hybridflow`` stays light.
"""

import sys
from typing import Any

from hybridflow.protocol import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto
from hybridflow.utils.deprecation import MovedModules

__version__ = "0.1.0"

#: Public module paths that moved (old -> new): the old one imports (and runs with ``python -m``) as the new
#: module, with a DeprecationWarning naming it, for one release. The README's "Public paths" lists both.
MOVED_MODULES = {
    "hybridflow.cli": "hybridflow.commands.cli",
    "hybridflow.demo": "hybridflow.commands.demo",
    "hybridflow.trainer.config": "hybridflow.config.schema",
    "hybridflow.trainer.config_checks": "hybridflow.config.checks",
    "hybridflow.trainer.config_docs": "hybridflow.config.docs",
    "hybridflow.trainer.config_loader": "hybridflow.config.loader",
    "hybridflow.trainer.offline_config": "hybridflow.config.offline",
}
if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(MovedModules(MOVED_MODULES))

_LAZY = {
    "PPOConfig": "hybridflow.trainer",
    "PPOTrainer": "hybridflow.trainer",
    "load_trained_actor": "hybridflow.runs.trained_model",
    "generation_batch": "hybridflow.data",
}

__all__ = [
    "DataProto",
    "DataProtoItem",
    "PPOConfig",
    "PPOTrainer",
    "generation_batch",
    "load_trained_actor",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    if name.endswith(("Config", "Entry")):  # the config's section classes
        import importlib

        config = importlib.import_module("hybridflow.config")
        if name in config.__all__:
            return getattr(config, name)
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
