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
