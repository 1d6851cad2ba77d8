"""``LinkedWeights`` (``hybridflow.trainer.weight_transport``) when a sync fails, on real Ray workers: a rollout
worker that dies mid-sync stops the run with its own loss (what auto-resume acts on), not the sender's broken
link, though the sender fails first; a sender that fails while the receivers live stops with the sender's
error."""

import os

import pytest

from hybridflow.config.schema import PPOConfig
from hybridflow.single_controller import ClassWithInitArgs, Dispatch, WorkerDiedError, WorkerError, register
from hybridflow.single_controller.ray import RayResourcePool, RayWorkerGroup
from hybridflow.trainer import weight_transport
from hybridflow.trainer.weight_transport import LinkedWeights
from hybridflow.workers import ActorRolloutRefWorker


class DiesOnReceive(ActorRolloutRefWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def receive_weights(self, version: int, staged: bool) -> dict[str, float]:
        os._exit(1)  # the rollout's process is gone before the first bucket, as when its machine is lost


class FailsToSend(ActorRolloutRefWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def send_weights(self, into_model: bool = False) -> dict[str, float] | None:
        raise RuntimeError("the sender's own failure")


def _sync(tiny_model_path, actor_class, rollout_class, name):
    cfg = PPOConfig()
    cfg.actor_rollout_ref.model.path = tiny_model_path
    arr = cfg.resolve().actor_rollout_ref
    pools = [RayResourcePool([1], cpus_per_process=1.0, name=f"{name}{role}") for role in ("a", "r")]
    actor = RayWorkerGroup(
        pools[0], ClassWithInitArgs(actor_class, arr, role="actor"), name_prefix=f"{name}a"
    )
    rollout = RayWorkerGroup(
        pools[1], ClassWithInitArgs(rollout_class, arr, role="rollout"), name_prefix=f"{name}r"
    )
    try:
        actor.init_model()
        rollout.init_model()
        LinkedWeights(actor, rollout).send(version=1, staged=False)
    finally:
        for group in (actor, rollout):
            group.shutdown()
        for pool in pools:
            pool.remove()


def test_a_receiver_lost_mid_sync_stops_the_run_with_its_loss(tiny_model_path, ray_session, monkeypatch):
    # the wait ends when Ray reports the loss; on a loaded machine (Ray's workers run at nice 15) that took
    # longer than the run's 60 s, and the sender's broken link was raised instead
    monkeypatch.setattr(weight_transport, "LOSS_WAIT_S", 600.0)
    with pytest.raises(WorkerDiedError) as lost:
        _sync(tiny_model_path, ActorRolloutRefWorker, DiesOnReceive, "wtdie")
    assert "receive_weights" in str(lost.value) and "wtdier" in str(lost.value)


def test_a_sender_failing_beside_live_receivers_stops_with_its_own_error(
    tiny_model_path, ray_session, monkeypatch
):
    monkeypatch.setattr(weight_transport, "LOSS_WAIT_S", 1.0)  # the receivers wait on: no loss to learn of
    with pytest.raises(WorkerError) as failed:
        _sync(tiny_model_path, FailsToSend, ActorRolloutRefWorker, "wtsend")
    assert not isinstance(failed.value, WorkerDiedError)
    assert "the sender's own failure" in str(failed.value)
