"""How the actor's weights reach a rollout worker of its own (``trainer.placement=split``, the asynchronous
modes): the ``WeightTransport`` contract both rollout sources (``rollouts.SyncRollouts``,
``async_rollout.AsyncRollouts``) send through, and its two implementations, picked by ``trainer.backend``.

On Ray the weights never pass through the driver (``LinkedWeights``: the actor's rank 0 streams them to the
rollout workers over a process group of their own, ``workers.weight_link``); on the local backend every worker
lives in the driver's process, so they go from one worker object to the other as arrays (``InProcessWeights``).
Either way the receiving worker loads them by what its rollout engine declares (``workers.weight_sync``).
"""

from __future__ import annotations

from typing import Protocol

from hybridflow.single_controller import NodeLostError, WorkerDiedError, WorkerError, WorkerGroup

#: how long a failed send waits to learn whether a receiver died (Ray reports a lost node within seconds)
LOSS_WAIT_S = 60.0


class WeightTransport(Protocol):
    """How the actor's weights reach a rollout worker of its own: ``send(version, staged)`` loads weight
    ``version`` there at once (lock-step) or, with ``staged``, keeps it as a version the rollout takes between
    generations or decoding steps (the worker's ``WeightFeed``); returns what the sync cost
    (``weight_sync/*`` metrics)."""

    def send(self, version: int, staged: bool) -> dict[str, float]:
        """Weight ``version`` to the rollout workers."""
        ...


class InProcessWeights:
    """The local backend: the actor and its rollout worker live in the driver's own process, so the weights go
    from one to the other as arrays (``get_weights``), loaded at once or posted as a version."""

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup) -> None:
        self.actor, self.rollout = actor, rollout

    def send(self, version: int, staged: bool) -> dict[str, float]:
        weights = self.actor.get_weights()[0]
        if staged:
            self.rollout.post_weights(weights, version)
        else:
            self.rollout.update_weights(weights)
        return {}


class LinkedWeights:
    """Ray: the actor's rank 0 streams the weights to the rollout workers over a process group of their own
    (``workers.weight_sync.WeightLink``), formed here when the run starts; the driver only starts both ends of
    each sync (and gets back what it cost), so the weights never pass through it."""

    def __init__(self, actor: WorkerGroup, rollout: WorkerGroup) -> None:
        self.actor, self.rollout = actor, rollout
        address = actor.weight_link_address(rollout.world_size)
        joining = [actor.join_weight_link(address), rollout.join_weight_link(address)]
        for future in joining:
            future.get()

    def send(self, version: int, staged: bool) -> dict[str, float]:
        """Weight ``version`` to every rollout worker, loaded there at once (lock-step) or kept as a version
        (``staged``: an asynchronous run generating meanwhile); the sender's and the slowest receiver's times."""
        # lock-step, the rollout does not generate meanwhile: straight into its model where the link can
        sent = self.actor.send_weights(into_model=not staged)
        received = self.rollout.receive_weights(version, staged)
        try:
            sender = sent.get()[0]
        except WorkerError as failure:
            # a receiver whose process or machine is gone shows on the sender as a broken link: the run stops
            # with the receiver's loss (which names the node, and which auto-resume acts on) where it is one
            try:
                received.get(timeout_s=LOSS_WAIT_S)
            except (WorkerDiedError, NodeLostError) as lost:
                raise lost from failure
            except WorkerError:
                pass  # the receivers are alive (or only slow): the sender's own error is the one
            raise
        receivers = received.get()
        slowest = max(receivers, key=lambda r: r["transfer_s"] + r["load_s"])
        return {
            "weight_sync/gather_s": sender["gather_s"],
            "weight_sync/send_s": sender["transfer_s"],
            "weight_sync/receive_s": slowest["transfer_s"],
            "weight_sync/load_s": slowest["load_s"],
            "weight_sync/mb": sender["bytes"] / 2**20,
        }


def weight_transport(backend: str, actor: WorkerGroup, rollout: WorkerGroup) -> WeightTransport:
    """How the actor's weights reach a rollout worker of its own on ``trainer.backend``."""
    return LinkedWeights(actor, rollout) if backend == "ray" else InProcessWeights(actor, rollout)
