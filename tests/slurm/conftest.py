"""Fixtures for the real-Slurm tests: one private cluster per session.

``slurm_cluster`` (one node) and ``slurm_cluster3`` (three nodes, each with its
own network, hostname and tmpfs scratch) share one cluster slot: a session
that uses both pays one restart when it switches. The cluster is started once,
reconfigured per test only when a test calls ``configure``, and torn down at
the end of the session, or by its lock holder if this process dies first.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import machine
from tests.slurm.harness import SETTINGS, Cluster, ClusterError
from tests.slurm.wrapped import reference_digests

# Another test run (or a cluster started by hand) holds the machine's cluster lock.
_LOCK_TIMEOUT = float(SETTINGS.get("SLURM_CKPT_CLUSTER_LOCK_TIMEOUT", "500"))
# SLURM_CKPT_CLUSTER_ATTACH=1: use the cluster already running (started by hand
# with cluster.sh up), never start, stop or clear it; cancel only our own jobs.
_ATTACH = SETTINGS.get("SLURM_CKPT_CLUSTER_ATTACH", "") not in ("", "0")


class _Slot:
    """The session's one cluster, or the error that stopped it from starting."""

    def __init__(self) -> None:
        self.cluster: Cluster | None = None
        self.error: str | None = None

    def get(self, nodes: int) -> Cluster:
        if os.geteuid() != 0:
            pytest.skip("the Slurm test cluster needs root (daemons, namespaces, mounts)")
        if nodes > 1:  # each node has a network namespace of its own, joined by veth and a bridge
            machine.need(machine.netns_links())
        if self.error is not None:
            pytest.fail(
                f"the Slurm test cluster could not start (see the first failure):\n{self.error}"
            )
        if self.cluster is not None and self.cluster.nodes == nodes:
            return self.cluster
        if _ATTACH:
            return self._attach(nodes)
        self.close()
        cluster = Cluster(nodes=nodes)
        try:
            # Below pytest-timeout (600 s), so a busy machine fails with the lock's message.
            cluster.up(owner=os.getpid(), lock_timeout=_LOCK_TIMEOUT)
        except (ClusterError, OSError, subprocess.SubprocessError) as e:
            self.error = str(e)
            pytest.fail(f"the Slurm test cluster could not start:\n{e}")
        self.cluster = cluster
        return cluster

    def _attach(self, nodes: int) -> Cluster:
        try:
            cluster = Cluster.attach()
        except (ClusterError, OSError) as e:
            pytest.fail(f"SLURM_CKPT_CLUSTER_ATTACH is set, but: {e}")
        if cluster.nodes != nodes:
            pytest.skip(
                f"the attached cluster has {cluster.nodes} node(s); this test needs {nodes}"
            )
        self.cluster = cluster
        return cluster

    def close(self) -> None:
        cluster, self.cluster = self.cluster, None
        if cluster is not None and not cluster.attached:
            cluster.down()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run one-node tests before three-node ones, so a session restarts the cluster once."""
    here = str(Path(__file__).parent)
    idx = [i for i, it in enumerate(items) if str(it.path).startswith(here)]
    ours = sorted((items[i] for i in idx),
                  key=lambda it: "slurm_cluster3" in getattr(it, "fixturenames", ()))  # fmt: skip
    for i, item in zip(idx, ours, strict=True):
        items[i] = item


@pytest.fixture(scope="session")
def _slurm_slot() -> Iterator[_Slot]:
    slot = _Slot()
    yield slot
    slot.close()


def _use(slot: _Slot, nodes: int) -> Iterator[Cluster]:
    cluster = slot.get(nodes)
    yield cluster
    # Leave the cluster as the next test expects it: no jobs, default settings.
    try:
        cluster.cancel_all()
        for node in cluster.node_names:
            state = cluster.node_state(node).upper()
            if "DRAIN" in state or state.startswith("DOWN"):
                cluster.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        if cluster.settings != cluster.base_settings:
            cluster.configure({k: None for k in cluster.settings} | cluster.base_settings)
    except (ClusterError, TimeoutError, OSError):
        # A cluster we cannot put back in order is restarted for the next test.
        slot.close()


@pytest.fixture
def slurm_cluster(_slurm_slot: _Slot) -> Iterator[Cluster]:
    """A running one-node cluster (node ``hostname -s``, 8 CPUs declared)."""
    yield from _use(_slurm_slot, 1)


@pytest.fixture
def slurm_cluster3(_slurm_slot: _Slot) -> Iterator[Cluster]:
    """A running three-node cluster: node1..node3, each in its own namespaces."""
    yield from _use(_slurm_slot, 3)


@pytest.fixture
def slurm_workdir(request: pytest.FixtureRequest, _slurm_slot: _Slot) -> Iterator[Path]:
    """A fresh directory for this test on the cluster's shared (durable) storage."""
    root = Cluster().root
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:80]
    # Next to the cluster root, not inside it: it must survive a cluster restart.
    path = root.with_name(root.name + "-work") / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    yield path


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], list[str]]:
    """``reference(trainer_args, world)``: digests of an uninterrupted run, computed once per args."""
    cache: dict[tuple[str, int], list[str]] = {}

    def get(trainer_args: str, world: int = 1) -> list[str]:
        # The reference runs unpaced whatever the args say (the weights do not depend on
        # the pacing), so args that differ only in pacing share one run.
        key = (re.sub(r"\s*--(first-)?step-time\s+\S+", "", trainer_args).strip(), world)
        if key not in cache:
            cache[key] = reference_digests(
                tmp_path_factory.mktemp("reference"), trainer_args, world
            )
        return cache[key]

    return get
