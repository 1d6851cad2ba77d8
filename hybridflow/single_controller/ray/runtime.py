"""Starting Ray for hybridflow on one machine (tests, laptops) with quiet, self-contained defaults."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray


def init_ray(num_cpus: int | None = None, _temp_dir: str | None = None, **kwargs: Any) -> bool:
    """Start a local Ray instance unless one is already running in this process.

    Returns True when this call started Ray (so the caller knows it should ``ray.shutdown()`` it, and
    must not shut down a Ray it did not start). Defaults: no dashboard, warnings-only logging, and
    ``RAY_AUTH_MODE=disabled`` unless already set. ``_temp_dir`` keeps Ray's session files (sockets, logs)
    in a folder of the caller's choosing; keep it short, since Unix socket paths inside it are limited to
    about 107 characters. Other keyword arguments go to ``ray.init``.
    """
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    options: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    options.update(kwargs)
    if _temp_dir is not None:
        options["_temp_dir"] = str(_temp_dir)
    ray.init(num_cpus=num_cpus, **options)
    return True
