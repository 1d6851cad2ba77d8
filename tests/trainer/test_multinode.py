"""A real two-node Ray cluster on this machine: two raylets started with ``ray start`` (node_a, the head, and
node_b), training driven by ``hybridflow train +trainer.ray_kwargs.address=...`` as a user would on a cluster.

What is simulated: both "nodes" are processes of one machine. Node_b's raylet (and so every worker it starts)
runs in a mount namespace of its own where one folder (``hidden/``) is covered by an empty tmpfs: to those
workers that folder is another filesystem, as an unshared disk is on a second machine. Everything else (the
two raylets, placement by custom resources, weight sync through the object store between the nodes, a node's
death as Ray detects it) is real.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

RAY = str(Path(sys.executable).with_name("ray"))


def _has_dashboard() -> bool:
    """Whether Ray's dashboard can start (ray[default]: `make test-cluster`), as Ray itself decides it."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError:
        return False
    return True


# `ray job submit` needs the dashboard on the head node
HAS_DASHBOARD = _has_dashboard()
# Ray declares a node dead after missed health checks: 4 x 0.5 s here, instead of about 15-30 s by default
NODE_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_failure_threshold": "4",
    "OMP_NUM_THREADS": "1",
}
LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 20.0
"""
SYNCED_TOL = 1e-4  # rollout/logprob_diff with weights synced (see test_placement.py)
# How long a wait for a state (a node joined, checkpoints written, a run ended) may take before the test gives
# up: a safety net for a run that hangs, never the expected time. A loaded machine (two cores kept busy by
# other jobs) ran these runs in 2-3 minutes where a quiet one takes under one; the old limits (180-300 s) were
# within reach of that.
PATIENCE_S = 900


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class TwoNodeCluster:
    """``ray start --head`` (node_a, 2 CPUs) and ``ray start --address`` (node_b, 1 CPU), each in its own
    process group, so one node can be killed whole (its raylet and its workers) as a crashed machine."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.hidden = root / "hidden"
        self.hidden.mkdir()
        self.env = {**os.environ, **NODE_ENV}
        port = _free_port()
        self.address = f"127.0.0.1:{port}"
        self.dashboard = f"http://127.0.0.1:{_free_port()}"  # the job server `ray job submit` talks to
        # every port a second Ray on this machine (another developer's tests) could also want is picked free
        common = ["--block", "--disable-usage-stats", f"--dashboard-agent-listen-port={_free_port()}"]
        self.head = self._start(
            [RAY, "start", "--head", f"--port={port}", f"--temp-dir={root / 'ray'}", f"--include-dashboard={HAS_DASHBOARD}",
             "--dashboard-host=127.0.0.1", f"--ray-client-server-port={_free_port()}",
             f"--dashboard-port={self.dashboard.rsplit(':', 1)[1]}",
             "--num-cpus=2", '--resources={"node_a": 1}', *common],
            "head",
        )  # fmt: skip
        # started at once: a joining node retries until the head's GCS answers
        node_b = [
            RAY,
            "start",
            f"--address={self.address}",
            "--num-cpus=1",
            '--resources={"node_b": 1}',
            *common,
        ]
        self.hides_folder = _can_unshare()
        if self.hides_folder:  # node_b sees an empty tmpfs over hidden/
            script = f'mount -t tmpfs tmpfs "{self.hidden}" && exec "$@"'
            node_b = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *node_b]
        self.node_b = self._start(node_b, "node_b")
        for name in ("head", "node_b"):
            self._wait_started(name)

    def _start(self, cmd: list[str], name: str) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(
            cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _wait_started(self, name: str, timeout_s: float = PATIENCE_S) -> None:
        """``ray start --block`` logs this once its node has joined the cluster (cheaper than `ray status`)."""
        log = self.root / f"{name}.log"
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in log.read_text():
            if time.monotonic() > deadline or (self.head.poll() is not None):
                raise RuntimeError(f"{name} did not start: {log.read_text()[-3000:]}")
            time.sleep(0.2)

    def kill_node_b(self) -> None:
        os.killpg(self.node_b.pid, signal.SIGKILL)
        self.node_b.wait()

    def stop(self) -> None:
        for proc in (self.node_b, self.head):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _can_unshare() -> bool:
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="hfmn-"))  # short: Ray's socket paths inside must stay < 107 chars
    nodes = TwoNodeCluster(root)
    yield nodes
    nodes.stop()
    shutil.rmtree(root, ignore_errors=True)


def _train_args(data_dir, model, run_dir, *overrides) -> list[str]:
    """``hybridflow train``'s arguments for a 4-prompt GRPO run of the tiny model, split placement on Ray."""
    reward = run_dir.parent / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    return [
        f"custom_reward_function.path={reward}",
        f"data.train_files={data_dir / 'train.parquet'}",
        f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={run_dir}",
        "data.max_prompt_length=64", "data.max_response_length=4", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.optim.lr=1e-2",
        "algorithm.adv_estimator=grpo", "trainer.logger=[file]", "trainer.val_before_train=false",
        "trainer.seed=3", "trainer.backend=ray", "trainer.placement=split", "trainer.cpus_per_worker=0.5",
        "+trainer.pool_resources.actor={node_a: 0.01}",
        "+trainer.role_pools.reward=actor",  # the reward function beside the actor: one process less
        *overrides,
    ]  # fmt: skip


def _train(cluster, data_dir, model, run_dir, *overrides, wait=True):
    """The driver started on this machine, pointed at the cluster (``+trainer.ray_kwargs.address``)."""
    cmd = [
        sys.executable, "-m", "hybridflow.commands.cli", "train",
        *_train_args(data_dir, model, run_dir, f"+trainer.ray_kwargs.address={cluster.address}", *overrides),
    ]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc.communicate(timeout=PATIENCE_S) + (proc.returncode,) if wait else proc


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _complete_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[-1]) for p in run_dir.glob("global_step_*/COMPLETE"))


def test_first_save_refuses_a_run_folder_a_node_cannot_see(cluster, data_dir, tiny_model_path, tmp_path):
    if not cluster.hides_folder:
        pytest.skip("no mount namespace here (unshare --mount needs root): cannot hide a folder from node_b")
    run = cluster.hidden / "run"  # the driver (and node_a) see it; node_b's workers see an empty tmpfs
    out, err, rc = _train(
        cluster, data_dir, tiny_model_path, run,
        "+trainer.pool_resources.rollout={node_b: 0.01}", "trainer.total_training_steps=2", "trainer.save_freq=1",
    )  # fmt: skip
    assert rc == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"hybridflow train: error: the run folder {run} is not shared with node "), last
    assert "worker group 'hybridflow/rollout/rollout'" in last
    assert _complete_steps(run) == [] and not list(run.glob(".tmp-*"))


@pytest.mark.skipif(
    not HAS_DASHBOARD, reason="needs ray[default] (Ray's dashboard): make test-cluster runs it"
)
def test_ray_job_submit_runs_the_driver_on_the_cluster(cluster, data_dir, tiny_model_path, tmp_path):
    """Ray's standard way: `ray job submit -- hybridflow train ...` with no address in the run's config (the
    job's driver finds its cluster through RAY_ADDRESS, which Ray sets), the driver on the head node."""
    run = tmp_path / "run"
    submit = [
        RAY, "job", "submit", f"--address={cluster.dashboard}", "--",
        str(Path(sys.executable).with_name("hybridflow")), "train",
        *_train_args(
            data_dir, tiny_model_path, run, "+trainer.pool_resources.rollout={node_a: 0.01}",
            "trainer.total_training_steps=2",
        ),
    ]  # fmt: skip
    out = subprocess.run(submit, env=cluster.env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert out.returncode == 0 and "succeeded" in out.stdout, (out.stdout + out.stderr)[-3000:]
    assert re.search(r"\[hybridflow/actor rank 0\] on node \w+ ", out.stdout), out.stdout[-3000:]
    assert [row["step"] for row in _steps(run)] == [1, 2]


@pytest.fixture(scope="module")
def lost_node_run(cluster, data_dir, tiny_model_path, tmp_path_factory):
    """A split run with the rollout on node_b, killed with node_b once it has saved 3 checkpoints (the
    module's last use of node_b): ``(run folder, driver stdout, driver stderr, exit status)``."""
    run = tmp_path_factory.mktemp("lost") / "run"
    proc = _train(
        cluster, data_dir, tiny_model_path, run,
        "+trainer.pool_resources.rollout={node_b: 0.01}", "trainer.total_training_steps=50", "trainer.save_freq=1",
        wait=False,
    )  # fmt: skip
    deadline = time.monotonic() + PATIENCE_S
    while len(_complete_steps(run)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert len(_complete_steps(run)) >= 3, f"no 3 checkpoints after {PATIENCE_S} s: {_complete_steps(run)}"
    cluster.kill_node_b()  # the machine holding the rollout is gone, mid-run
    out, err = proc.communicate(timeout=PATIENCE_S)
    return run, out, err, proc.returncode


def test_split_placement_trains_across_two_nodes(lost_node_run):
    run, out, err, _ = lost_node_run
    # each worker logs its node (Ray forwards the line to the driver): the actor and the rollout on two nodes
    nodes = dict(re.findall(r"\[hybridflow/(\w+) rank 0\] on node (\w+) ", out))
    assert set(nodes) == {"actor", "rollout"}, out[-3000:]
    assert nodes["actor"] != nodes["rollout"]
    steps = _steps(run)[:3]
    assert [row["step"] for row in steps] == [1, 2, 3]
    # the rollout on node_b samples with the weights the actor on node_a just trained, every step
    assert all(row["rollout/logprob_diff_max"] < SYNCED_TOL for row in steps)
    assert all(row["timing_s/sync_weights"] > 0 for row in steps)
    assert _complete_steps(run)[:3] == [1, 2, 3]


def test_losing_the_rollout_node_stops_the_run_and_auto_resume_goes_on(
    lost_node_run, cluster, data_dir, tiny_model_path
):
    run, _, err, rc = lost_node_run
    assert rc == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"hybridflow train: error: node \w+ \([\d.]+\) left the Ray cluster during '\w+', taking role "
        r"'rollout' \(worker group 'hybridflow/rollout/rollout', rank 0\) with it; .*resume_mode=auto.*",
        last,
    ), last
    newest = _complete_steps(run)[-1]

    # the cluster that is left: node_a alone takes the rollout too; the run resumes from the newest checkpoint
    out, err, rc = _train(
        cluster, data_dir, tiny_model_path, run,
        "+trainer.pool_resources.rollout={node_a: 0.01}", f"trainer.total_training_steps={newest + 1}",
        "trainer.save_freq=1", "trainer.resume_mode=auto",
    )  # fmt: skip
    assert rc == 0, err[-3000:]
    assert f"resumed from {run / f'global_step_{newest}'} at step {newest}" in err
    assert _steps(run)[-1]["step"] == newest + 1
    assert _complete_steps(run)[-1] == newest + 1
