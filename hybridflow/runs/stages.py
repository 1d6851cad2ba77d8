"""The stages of a training step: one vocabulary for the trainers' timers, the ``timing_s/<stage>`` metrics,
the console line's timings, the run timeline's lanes and the report's colours.

Each stage names the worker group that runs it (its lane in the timeline; ``driver`` is the trainer's own
process) and, for the few the console line shows, its label there. ``STAGES`` lists them in the order a step
runs them, which is the order the report stacks and colours them in. A stage that is not here cannot be timed
(``trainer.metrics.timer`` refuses it), so a new one is added here, once, and everything follows.
"""

from __future__ import annotations

from typing import NamedTuple


class Stage(NamedTuple):
    """A stage: its name (``timing_s/<name>``), the worker group that runs it, what it is, its console label."""

    name: str
    group: str
    what: str
    console: str = ""


STAGES: tuple[Stage, ...] = (
    Stage("gen", "actor_rollout", "generation (asynchronous runs: waiting for the producer's batch)", "gen"),
    Stage("rollout", "rollout", "an asynchronous run's producer generating, beside the training stages"),
    Stage("reward", "driver", "scoring the responses (a reward worker or model scores on its own pool)"),
    Stage(
        "old_log_prob", "actor_rollout", "the old policy's log-probs, when the data is used more than once"
    ),
    Stage("ref", "ref", "the reference policy's log-probs"),
    Stage("teacher", "teacher", "the teacher's log-probs (on-policy distillation)"),
    Stage("values", "critic", "the critic's values"),
    Stage("adv", "driver", "the KL penalty and the advantages"),
    Stage("update_critic", "critic", "the critic's update"),
    Stage("update_actor", "actor_rollout", "the policy update", "upd"),
    Stage(
        "update_rm",
        "actor_rollout",
        "a reward model's update (hybridflow rm trains it in the actor's group)",
        "upd",
    ),
    Stage("replay_priorities", "actor_rollout", "the replay buffer's new priorities"),
    Stage("sync_weights", "rollout", "the actor's weights sent to a rollout worker of its own"),
    Stage("validate", "actor_rollout", "validation on the held-out prompts"),
    Stage("checkpoint", "actor_rollout", "saving a checkpoint"),
    Stage("step", "driver", "the whole training step", "step"),
)
STAGE_ORDER: tuple[str, ...] = tuple(stage.name for stage in STAGES)
#: stage -> the worker group that runs it (the timeline's lane)
STAGE_GROUPS: dict[str, str] = {stage.name: stage.group for stage in STAGES}
#: (console label, metric) of the timings the console line shows
CONSOLE_TIMINGS: tuple[tuple[str, str], ...] = tuple(
    (stage.console, f"timing_s/{stage.name}") for stage in STAGES if stage.console
)
