"""The commands a user types: the ``hybridflow`` command line (``cli``), ``hybridflow doctor`` with its report's
vocabulary (``diagnosis``), its data checks (``doctor_data``), its memory estimate (``memory_estimate``) and its
reward probes (``reward_probes``), ``hybridflow report`` (``report``, which draws what ``report_data`` reads
from a run folder), ``hybridflow generate``, ``hybridflow serve`` (``serve``: loading a checkpoint and serving
it) and ``make demo`` (``python -m hybridflow.commands.demo``).

The top layer: may import every other room; nothing imports it.
"""
