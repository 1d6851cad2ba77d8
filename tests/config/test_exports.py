"""``hybridflow.config`` lists its section classes by name (so a type checker sees them); none may be missing."""

import hybridflow
import hybridflow.config as config
from hybridflow.config.schema import SECTION_CLASSES


def test_every_section_class_is_exported_by_name():
    missing = sorted(set(SECTION_CLASSES) - set(config.__all__))
    assert not missing, f"add {missing} to hybridflow/config/__init__.py (imports and __all__)"
    for name, cls in SECTION_CLASSES.items():
        assert getattr(config, name) is cls
        assert getattr(hybridflow, name) is cls
    assert {"PPOConfig", "load_config", "ConfigError"} <= set(config.__all__)
    assert all(hasattr(config, name) for name in config.__all__)
