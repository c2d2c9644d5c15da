"""The test cluster itself: jobs run, requeue works, hooks plug in, nodes are separate."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.slurm.harness import SCRIPT, SETTINGS, VENV_BIN, Cluster

pytestmark = pytest.mark.slurm


def test_batch_job_runs_and_requeue_wait_is_skipped(
    slurm_cluster: Cluster, slurm_workdir: Path
) -> None:
    job = slurm_cluster.sbatch(
        'echo "run restart=${SLURM_RESTART_COUNT:-0} host=$(hostname)"\n'
        'srun bash -c \'echo "step on $SLURMD_NODENAME"\'\n'
        '[ "${SLURM_RESTART_COUNT:-0}" -ge 1 ] || sleep 300\n',
        "--requeue", workdir=slurm_workdir, name="requeue",
    )  # fmt: skip
    job.wait_output(r"^step on ")
    assert job.info()["Restarts"] == "0"
    slurm_cluster.run("scontrol", "requeue", job.id)
    job.skip_requeue_wait(restarts=1)
    rec = job.wait_state("COMPLETED", timeout=60)
    assert rec["Restarts"] == "1"
    runs = re.findall(r"^run restart=(\d+) host=(\S+)$", job.output(), re.MULTILINE)
    assert runs == [("0", slurm_cluster.node_names[0]), ("1", slurm_cluster.node_names[0])]


def test_failed_job_reports_its_exit_code(slurm_cluster: Cluster, slurm_workdir: Path) -> None:
    job = slurm_cluster.sbatch(
        "srun bash -c 'exit 7'\nexit 7\n", workdir=slurm_workdir, name="fail"
    )
    rec = job.wait_finished()
    assert (rec["JobState"], rec["ExitCode"]) == ("FAILED", "7:0")


def test_prolog_and_epilog_plug_in_through_configure(
    slurm_cluster: Cluster, slurm_workdir: Path
) -> None:
    """How the node hooks are tested: configure() sets them for one test, then they are gone."""
    hook = slurm_workdir / "hook.sh"
    # Hooks run as root with no PATH; $0 says which hook ran.
    hook.write_text(
        '#!/bin/sh\n/usr/bin/env > "$(/usr/bin/dirname "$0")/env-$(/usr/bin/basename "$0")"\n'
    )
    hook.chmod(0o755)
    for name in ("prolog", "epilog"):
        (slurm_workdir / name).symlink_to(hook)
    slurm_cluster.configure({"Prolog": slurm_workdir / "prolog", "Epilog": slurm_workdir / "epilog",
                             "PrologFlags": "Alloc"})  # fmt: skip
    assert "Prolog" in slurm_cluster.run("scontrol", "show", "config")
    job = slurm_cluster.sbatch(
        "srun true\n", "--comment=scratch=2G", workdir=slurm_workdir, name="hooks"
    )
    job.wait_state("COMPLETED")
    env = slurm_workdir / "env-epilog"
    env_text = env.read_text() if env.exists() else ""
    if not env_text:  # the epilog may still be running when the job reads COMPLETED
        job.wait_for("epilog output", lambda _: bool(env.exists() and env.read_text()), 30)
        env_text = env.read_text()
    prolog = dict(
        line.split("=", 1)
        for line in (slurm_workdir / "env-prolog").read_text().splitlines()
        if "=" in line
    )
    assert prolog["SLURM_JOB_ID"] == job.id
    assert prolog["SLURM_JOB_COMMENT"] == "scratch=2G"
    assert f"SLURM_JOB_ID={job.id}" in env_text


def test_second_cluster_waits_for_the_lock(slurm_cluster: Cluster, tmp_path: Path) -> None:
    env = slurm_cluster.env({"SLURM_CKPT_CLUSTER_ROOT": str(tmp_path / "other"),
                             "SLURM_CKPT_CLUSTER_LOCK_TIMEOUT": "1"})  # fmt: skip
    proc = subprocess.run(["bash", str(SCRIPT), "up"], env=env, capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "holds" in proc.stderr
    assert not (tmp_path / "other").exists()
    assert slurm_cluster.run("scontrol", "ping").count("is UP") == 1


def test_failed_start_says_why_and_leaves_nothing(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """A cluster that cannot start fails with the daemons' own words and cleans up.

    Its own root, lock and ports, so it does not touch the session's cluster.
    """
    # Not under tmp_path: pytest's temp dirs are 0700 and munged runs as munge.
    root = Path(f"/tmp/slurm-ckpt-broken-{os.getpid()}")
    env = slurm_cluster.env({"SLURM_CKPT_CLUSTER_ROOT": str(root),
                             "SLURM_CKPT_CLUSTER_LOCK": str(tmp_path / "lock"),
                             "SLURM_CKPT_CLUSTER_PORT": "26817"})  # fmt: skip
    proc = subprocess.run(["bash", str(SCRIPT), "up", "--set", "NoSuchSetting=1"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "NoSuchSetting" in proc.stderr
    assert "slurmctld did not start" in proc.stderr
    assert not root.exists()
    leftovers = subprocess.run(
        ["pgrep", "-f", str(root)], capture_output=True, text=True, check=False
    )
    assert leftovers.stdout == ""
    assert (
        subprocess.run(["flock", "-n", str(tmp_path / "lock"), "true"], check=False).returncode == 0
    )


def test_a_cluster_whose_ports_are_taken_moves_to_free_ones(slurm_cluster: Cluster, tmp_path: Path) -> None:
    """The session's cluster holds its ports; a second one, given no ports, starts on others."""
    root = Path(f"/tmp/slurm-ckpt-ports-{os.getpid()}")  # munged must reach it: not under tmp_path
    env = slurm_cluster.env({"SLURM_CKPT_CLUSTER_ROOT": str(root), "SLURM_CKPT_CLUSTER_LOCK": str(tmp_path / "lock")})
    env.pop("SLURM_CKPT_CLUSTER_PORT", None)
    busy = re.search(r"^SlurmctldPort=(\d+)", slurm_cluster.conf.read_text(), re.M)
    assert busy is not None
    try:
        up = subprocess.run(["bash", str(SCRIPT), "up"], env=env, capture_output=True, text=True,
                            timeout=120, check=False)  # fmt: skip
        assert up.returncode == 0, up.stderr
        assert "are taken: using" in up.stderr
        port = re.search(r"^SlurmctldPort=(\d+)", (root / "etc" / "slurm.conf").read_text(), re.M)
        assert port is not None and port[1] != busy[1]
        ping = subprocess.run(["scontrol", "ping"], env=env | {"SLURM_CONF": str(root / "etc" / "slurm.conf")},
                              capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
        assert "is UP" in ping.stdout
    finally:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True, timeout=120, check=False)
    assert slurm_cluster.run("scontrol", "ping").count("is UP") == 1


GLOO = """\
import os, socket, torch, torch.distributed as dist
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:29400",
                        rank=rank, world_size=world)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank {rank} on {socket.gethostname()} sum {t.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_three_nodes_one_task_each_with_own_scratch(
    slurm_cluster3: Cluster, slurm_workdir: Path
) -> None:
    scratch = slurm_cluster3.scratch
    job = slurm_cluster3.sbatch(
        "srun -N2 --ntasks-per-node=1 bash -c "
        f"'hostname > {scratch}/mine; echo \"$(hostname) sees $(ls {scratch})\"'\n",
        "-N2", "--ntasks-per-node=1", workdir=slurm_workdir, name="two",
    )  # fmt: skip
    job.wait_state("COMPLETED")
    seen = sorted(re.findall(r"^(node\d) sees (.*)$", job.output(), re.MULTILINE))
    assert [host for host, _ in seen] == ["node1", "node2"]
    assert all(files == "mine" for _, files in seen)
    for node in ("node1", "node2"):
        assert slurm_cluster3.on_node(node, scratch / "mine").read_text().strip() == node
    assert not (slurm_cluster3.on_node("node3", scratch) / "mine").exists()
    assert not (scratch / "mine").exists()  # the host does not see node-local scratch


def test_gloo_all_reduce_across_nodes(slurm_cluster3: Cluster, slurm_workdir: Path) -> None:
    (slurm_workdir / "gloo.py").write_text(GLOO)
    job = slurm_cluster3.sbatch(
        f"export MASTER_ADDR={slurm_cluster3.node_addr('node1')}\n"
        f"srun {VENV_BIN}/python {slurm_workdir}/gloo.py\n",
        "-N2", "--ntasks-per-node=1", "-w", "node1,node2", workdir=slurm_workdir, name="gloo",
    )  # fmt: skip
    job.wait_state("COMPLETED", timeout=120)
    ranks = sorted(re.findall(r"^rank (\d) on (node\d) sum (\S+)$", job.output(), re.MULTILINE))
    assert ranks == [("0", "node1", "3"), ("1", "node2", "3")]


def test_down_removes_namespaces_processes_and_lock(
    slurm_cluster3: Cluster, slurm_workdir: Path
) -> None:
    """Tear down with a job still running; nothing of the cluster may remain."""
    job = slurm_cluster3.sbatch("srun -N3 bash -c 'echo up; exec sleep 600'\n", "-N3",
                                workdir=slurm_workdir, name="left")  # fmt: skip
    job.wait_output(r"^up$", count=3)
    mntns = [p.read_text().strip() for p in (slurm_cluster3.root / "run").glob("*.mntns")]
    assert len(mntns) == 3
    slurm_cluster3.down()
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _mntns(pid) in mntns]
    assert left == []
    netns = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert SETTINGS.get("SLURM_CKPT_CLUSTER_NETNS", "slurm-ckpt-node") not in netns
    links = subprocess.run(["ip", "link"], capture_output=True, text=True, check=True).stdout
    assert SETTINGS.get("SLURM_CKPT_CLUSTER_BRIDGE", "sckbr0") not in links
    assert slurm_cluster3.node_link("node1") not in links
    assert not slurm_cluster3.root.exists()
    lock = SETTINGS.get("SLURM_CKPT_CLUSTER_LOCK", "/run/lock/slurm-ckpt-cluster.lock")
    free = subprocess.run(["flock", "-n", lock, "true"], check=False)
    assert free.returncode == 0
    # The fixture's teardown finds the cluster gone and restarts it for the next test.
    slurm_cluster3.up(owner=os.getpid())


def _mntns(pid: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return ""
