"""Calls on a 2-rank ToyWorker group: every dispatch mode gives the same hand-computed answers on a
LocalWorkerGroup and on 2 Ray actors; then what only the Ray actors can show (process group, overlap).

The Ray group is module-scoped: starting actors costs seconds, and its resources go back to the cluster
when this file is done (other test folders share the Ray session)."""

import inspect
import os
import re
import time

import numpy as np
import pytest
import torch
from toy_workers import ToyWorker

from hybridflow import DataProto
from hybridflow.single_controller import ClassWithInitArgs, LocalWorkerGroup, WorkerError, WorkerFuture
from hybridflow.utils.errors import InputError


@pytest.fixture(scope="module")
def ray_group(ray_session):
    """2 ranks of half a CPU each; the other CPU of the 2-CPU session stays free for other tests."""
    from hybridflow.single_controller.ray import RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([2], cpus_per_process=0.5, name="toy")
    group = RayWorkerGroup(pool, ClassWithInitArgs(ToyWorker, offset=3), name_prefix="toy")
    yield group
    group.shutdown()
    pool.remove()


@pytest.fixture(scope="module", params=["local", "ray"])
def group(request):
    if request.param == "ray":
        return request.getfixturevalue("ray_group")
    return LocalWorkerGroup(ClassWithInitArgs(ToyWorker, offset=3), world_size=2, name_prefix="toy")


def five_rows() -> DataProto:
    """5 rows: does not divide by 2, so the dispatch pads one row."""
    return DataProto.from_dict({"x": torch.arange(5)}, non_tensors={"uid": list("abcde")})


def test_group_binds_registered_methods_with_worker_signature(group):
    assert group.world_size == 2
    assert inspect.signature(group.add_rank) == inspect.signature(lambda x, y=0: None).replace(
        parameters=[
            p.replace(annotation=int) for p in inspect.signature(lambda x, y=0: None).parameters.values()
        ],
        return_annotation=int,
    )
    assert group.tag_rows.__doc__.startswith("Doubles")
    assert not hasattr(group, "whoami")  # not registered


def test_one_to_all_reaches_every_rank_with_its_env(group):
    infos = group.info()
    assert [(i["rank"], i["world_size"], i["offset"], i["device"]) for i in infos] == [
        (0, 2, 3, "cpu"),
        (1, 2, 3, "cpu"),
    ]


def test_all_to_all_and_dp_compute_split_lists(group):
    assert group.add_rank([1, 2], y=[100, 200]) == [101, 212]
    assert group.dp([3, 4]) == [6, 9]
    with pytest.raises(ValueError, match="argument 0 must be a list of 2 per-rank values"):
        group.add_rank([1, 2, 3])


def test_rank_zero_modes(group):
    assert group.only_zero(7) == (0, 7)
    assert group.broadcast_on_zero(7) == [8]  # Execute.RANK_ZERO: only rank 0's answer
    assert group.execute_rank_zero("whoami") == 0
    assert group.execute_all("whoami") == [0, 1]


def test_dp_compute_proto_pads_splits_and_unpads(group):
    out = group.tag_rows(five_rows())
    assert out.batch["x"].tolist() == [0, 2, 4, 6, 8]
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]  # 3 rows each; rank 1's padding row removed
    assert out.non_tensor_batch["uid"].tolist() == list("abcde")
    assert out.meta_info["metrics"] == {"rows": [3, 3]}


def test_dp_compute_metric_splits_and_lists(group):
    # rank 0 sums rows 0..2 = 3; rank 1 sums rows 3, 4 and the padding copy of row 0 = 7
    assert group.row_sum(five_rows()) == [{"rank": 0, "sum": 3}, {"rank": 1, "sum": 7}]


def test_user_registered_dispatch_mode(group):
    assert group.square([1, 2, 3, 4, 5]) == [(1, 0), (4, 1), (9, 0), (16, 1), (25, 0)]


def test_future_feeds_the_next_call(group):
    future = group.tag_rows_async(five_rows())
    assert isinstance(future, WorkerFuture)
    out = group.tag_rows(future.get().select(batch_keys=["x"], non_tensor_batch_keys=["uid"]))
    assert out.batch["x"].tolist() == [0, 4, 8, 12, 16]
    chained = group.row_sum(group.tag_rows_async(five_rows()))  # the future itself as the argument
    assert chained == [{"rank": 0, "sum": 0 + 2 + 4}, {"rank": 1, "sum": 6 + 8 + 0}]


def test_worker_exception_names_group_rank_method_and_traceback(group):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        group.fail_on(1)
    assert time.monotonic() - start < 10
    err = info.value
    assert (err.group, err.rank, err.method) == ("toy", 1, "fail_on")
    message = str(err)
    assert "'toy', rank 1, method 'fail_on'" in message
    assert "ValueError: boom from rank 1" in message and "toy_workers.py" in message
    assert group.fail_on(-1) == [0, 1]  # the group still works afterwards


def test_an_input_error_in_a_worker_reaches_the_driver_as_itself(group):
    """Same type and message as raised in the worker (so ``hybridflow train`` prints it as one line); where
    it happened is its ``__cause__``."""
    with pytest.raises(InputError) as info:
        group.refuse_input(1)
    assert str(info.value) == "data.bin: row 1 is malformed"
    where = info.value.__cause__
    assert isinstance(where, WorkerError) and (where.group, where.rank, where.method) == (
        "toy",
        1,
        "refuse_input",
    )
    assert "toy_workers.py" in where.remote_traceback


def test_dataproto_argument_is_not_resized_for_the_caller(group):
    data = five_rows()
    group.tag_rows(data)
    assert len(data) == 5 and np.array_equal(data.batch["x"].numpy(), np.arange(5))


# ----------------------------------------------------------------------------------------- Ray only
def test_two_ray_workers_form_a_gloo_group_and_all_reduce(ray_group):
    infos = ray_group.info()
    assert [i["formed_group"] for i in infos] == [True, True]
    pids = {i["pid"] for i in infos}
    assert len(pids) == 2 and os.getpid() not in pids
    assert ray_group.all_reduce(1.5) == [4.5, 4.5]  # 1.5 * 1 + 1.5 * 2 on both ranks


def test_non_blocking_call_returns_before_the_workers_finish(ray_group):
    start = time.monotonic()
    future = ray_group.sleep(0.5)
    assert time.monotonic() - start < 0.3
    assert future.get() == [0, 1]
    assert time.monotonic() - start >= 0.5


def test_future_wait_can_time_out_and_be_retried(ray_group):
    future = ray_group.sleep(0.8)
    with pytest.raises(
        WorkerError, match=re.escape("method 'sleep' failed:\nno answer within 0.1 s from ranks [0, 1]")
    ):
        future.get(timeout_s=0.1)
    assert future.get() == [0, 1]
