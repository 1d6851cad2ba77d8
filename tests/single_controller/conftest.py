"""One Ray instance for the whole test session (starting Ray costs seconds), reused if already running."""

import shutil
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """Ray on 2 CPUs with its session files in a short temporary folder; shut down only if started here."""
    import ray

    from hybridflow.single_controller.ray import init_ray

    if ray.is_initialized():
        yield
        return
    temp_dir = tempfile.mkdtemp(prefix="hfray-")  # short: Ray's socket paths inside must stay < 107 chars
    started = init_ray(num_cpus=2, _temp_dir=temp_dir)
    yield
    if started:
        ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_pool(ray_session):
    """2 processes of half a CPU on one node, shared by the session's Ray groups (up to 4 at once); the
    other CPU stays free for the resource-pool tests."""
    from hybridflow.single_controller.ray import RayResourcePool

    pool = RayResourcePool([2], max_colocate_count=4, cpus_per_process=0.5, name="tests")
    yield pool
    pool.remove()


@pytest.fixture(scope="session")
def ray_toy_group(ray_pool):
    """The 2-rank Ray group of ToyWorker shared by the test files (each Ray group costs seconds to start)."""
    from toy_workers import ToyWorker

    from hybridflow.single_controller import ClassWithInitArgs
    from hybridflow.single_controller.ray import RayWorkerGroup

    group = RayWorkerGroup(ray_pool, ClassWithInitArgs(ToyWorker, offset=3), name_prefix="toy")
    yield group
    group.shutdown()
