"""The run folder and what a run records in it: checkpoints (``checkpoint``: atomic saves, manifests,
resuming), the run lock (``lock``), tracking (``tracking``: the console line, JSONL, TensorBoard, W&B,
MLflow), the stages a step is timed by (``stages``: the vocabulary of ``timing_s/*`` and the timeline), and
loading a trained actor back (``trained_model``).

Beside ``single_controller``, ``rewards`` and ``tools`` in the layering: the trainers write runs, the commands
read them. May import: ``utils``, ``protocol``, ``models``, ``algorithms``, ``dataflow``, ``config``.
"""
