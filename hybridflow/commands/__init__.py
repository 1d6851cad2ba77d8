"""The commands a user types: the ``hybridflow`` command line (``cli``), ``hybridflow doctor`` with its memory
estimate, ``hybridflow report``, ``hybridflow generate``, ``hybridflow serve`` (``serve``: loading a checkpoint
and serving it) and ``make demo`` (``python -m hybridflow.commands.demo``).

The top layer: may import every other room; nothing imports it.
"""
