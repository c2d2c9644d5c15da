"""Hostile users against the hooks as slurmd runs them: through the shims that
scripts/install-hooks.sh installs, with their watchdog and log, an environment
holding only the job's fields (no PATH), two ordinary users on one node.

Each test is an attack that drained a node or denied scratch to other users;
each asserts the hook's exit status (non-zero drains the node) and what the
other user still gets.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt.store.layout import fast_dir
from tests.faultfs.mounts import mount_faultfs
from tests.node.helpers import User, dead_fuse_of, fuse_of, owned_tree, sh, write_ckpt, write_config

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).with_name("slurm-ckpt")


@dataclass
class Node:
    """One node's installed hooks, its scratch base, durable root and textfile dir."""

    hooks: Path
    config: Path
    base: Path
    root: Path
    prom: Path

    def settings(self, **extra: str) -> None:
        """Rewrite hooks.env: what install-hooks.sh writes, plus ``extra`` (a watchdog)."""
        lines = {"SLURM_CKPT_BIN": str(BIN), "SLURM_CKPT_CONFIG": str(self.config),
                 "SLURM_CKPT_HOOK_LOG": str(self.log_path), **extra}  # fmt: skip
        (self.hooks / "hooks.env").write_text("".join(f"{k}={v}\n" for k, v in lines.items()))

    @property
    def log_path(self) -> Path:
        return self.hooks / "log" / "hooks.log"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def run(self, hook: str, user: User, job_id: str, **env: str) -> tuple[int, float]:
        """The shim as slurmd runs it (``env -i`` plus the job's fields); its exit status and seconds."""
        t0 = time.monotonic()
        p = subprocess.run([str(self.hooks / f"slurm-ckpt-{hook}")], env=user.env(job_id, **env),
                           capture_output=True, text=True, timeout=600)  # fmt: skip
        return p.returncode, time.monotonic() - t0

    def scratch(self, job_id: str) -> Path:
        return self.base / f"job_{job_id}"

    def write_config(self, **sections: dict[str, Any]) -> None:
        metrics = {"textfile_dir": str(self.prom)}
        write_config(self.config, self.base, self.root, metrics=metrics, **sections)


@pytest.fixture
def node(pub_tmp: Path, scratch_base: Path, user: User, other_user: User) -> Node:
    d = pub_tmp / "hooks"
    n = Node(d, pub_tmp / "config.yaml", scratch_base, pub_tmp / "shared", pub_tmp / "prom")
    n.write_config()
    p = subprocess.run(["bash", str(REPO / "scripts" / "install-hooks.sh"), "--dest", str(d), "--bin", str(BIN),
                        "--config", str(n.config), "--log", str(n.log_path)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    n.prom.mkdir()
    n.prom.chmod(0o1777)  # as the config template says
    for u in (user, other_user):
        owned_tree(n.root / u.name, u)
    return n


def test_metrics_names_a_user_makes_are_left_alone_and_cost_nothing(node: Node, user: User) -> None:
    """Only the exact names the library writes go; the dir is never listed."""
    assert node.run("prolog", user, "701")[0] == 0, node.log()
    script = ("cd \"$1\" && echo x > slurm_ckpt_701_0.prom && echo x > slurm_ckpt_701_1.prom && "
              "mkdir slurm_ckpt_701_2.prom && seq -f 'slurm_ckpt_701_%gjunk.prom' 1 20000 | xargs touch && "
              "ln -s /etc/passwd slurm_ckpt_701_3.prom")  # fmt: skip
    user.run("/bin/sh", "-c", script, "sh", str(node.prom))
    rc, _ = node.run("epilog", user, "701")
    assert rc == 0, node.log()
    left = set(os.listdir(node.prom))
    assert "slurm_ckpt_701_0.prom" not in left and "slurm_ckpt_701_1.prom" not in left
    assert "slurm_ckpt_701_3.prom" not in left and Path("/etc/passwd").exists()  # the link, not its target
    assert "slurm_ckpt_701_2.prom" in left  # a directory at the name: never walked
    assert sum(n.endswith("junk.prom") for n in left) == 20000


def test_the_epilog_stays_clear_of_the_watchdog_when_the_stage_out_hangs(node: Node, user: User) -> None:
    """The config gives the epilog 240 s, the shim's watchdog 15 s: every step of the epilog
    shares one deadline that ends before the watchdog, so a stage-out hung on the user's FUSE
    mount costs the node nothing."""
    node.settings(SLURM_CKPT_EPILOG_WATCHDOG="15")
    assert node.run("prolog", user, "702")[0] == 0, node.log()
    write_ckpt(fast_dir(node.scratch("702")), 5, owner=user)
    durable = node.root / user.name / "job_702"
    owned_tree(durable, user)
    with fuse_of(user, durable, hung=True):
        rc, took = node.run("epilog", user, "702")
    assert rc == 0, node.log()
    assert took < 15
    assert "keeping scratch" in node.log()  # the only copy of the checkpoint stays
    assert (fast_dir(node.scratch("702")) / "step-000000005").is_dir()
    sh("umount", "-l", str(node.scratch("702")), check=False)


def _ledger(node: Node) -> dict[str, dict[str, Any]]:
    import json

    return json.loads((node.base / ".slurm-ckpt" / "ledger.json").read_text())  # type: ignore[no-any-return]


def _failing_job(node: Node, user: User, job_id: str, **env: str) -> None:
    """A job whose stage-out fails on its own data: a checkpoint whose manifest its user made unreadable."""
    assert node.run("prolog", user, job_id, **env)[0] == 0, node.log()
    step = write_ckpt(fast_dir(node.scratch(job_id)), 1, owner=user)
    (step / "MANIFEST.json").chmod(0)
    assert node.run("epilog", user, job_id)[0] == 0, node.log()


def test_a_kept_scratch_never_blocks_another_users_job(node: Node, user: User, other_user: User) -> None:
    """A one-second job takes the whole node's scratch and fails its own stage-out: it is kept,
    but the next user's job gets its scratch, and the kept one is dropped with a log line."""
    node.write_config(scratch={"over_reserve": "none", "keep_per_user": "1G"})
    _failing_job(node, user, "711", SLURM_JOB_COMMENT="ckpt_scratch=480M")
    kept = _ledger(node)["711"]
    assert kept["kept"] and kept["size"] == 480 * 2**20
    assert kept["keep_for"] == pytest.approx(86400 * 64 / 480)  # its own data (a 7th), 7.5x the default size
    assert node.run("prolog", other_user, "712")[0] == 0, node.log()
    assert _ledger(node)["712"]["size"] == 64 * 2**20 and "711" not in _ledger(node)
    assert node.scratch("712").is_dir() and not node.scratch("711").exists()
    assert "dropping kept scratch 711" in node.log() and "job 712 needs the room" in node.log()
    assert node.run("epilog", other_user, "712")[0] == 0


def test_a_user_holds_at_most_keep_per_user_of_kept_scratch(node: Node, user: User) -> None:
    node.write_config(scratch={"keep_per_user": "150M"})
    for job_id in ("721", "722", "723"):
        _failing_job(node, user, job_id)
    ledger = _ledger(node)
    assert "721" not in ledger and ledger["722"]["kept"] and ledger["723"]["kept"]  # the oldest went
    assert not node.scratch("721").exists() and node.scratch("723").is_dir()
    assert ledger["723"]["keep_for"] == pytest.approx(86400)  # a seventh of 7 days
    _failing_job(node, user, "724", SLURM_JOB_COMMENT="ckpt_scratch=200M")  # alone over the cap
    assert "724" not in _ledger(node) and not node.scratch("724").exists()
    assert "not keeping scratch" in node.log()


def test_keep_time_follows_size_and_cause() -> None:
    from slurm_ckpt.config import ScratchConfig
    from slurm_ckpt.node.epilog import keep_time
    from slurm_ckpt.node.stageresult import StageResult

    sc = ScratchConfig(default_size=10 * 2**30)  # type: ignore[arg-type]
    week, slow = 7 * 86400, StageResult("timeout", "stage-out still running after 200s; killed")
    own = StageResult("failed", "unreadable checkpoint(s): MANIFEST.json: Permission denied")
    assert keep_time(sc, 10 * 2**30, slow) == week
    assert keep_time(sc, 10 * 2**30, StageResult("failed", "no allowed durable run dir: x")) == week
    assert keep_time(sc, 10 * 2**30, own) == week / 7
    assert keep_time(sc, 20 * 2**30, slow) == week / 2
    assert keep_time(sc, 2**40, own) == 3600


def _age(node: Node, job_id: str) -> None:
    """Make a reservation older than a prolog's time budget, as it is once its job has run a while
    (younger ones are taken as still being made, and their dirs are not looked at)."""
    import json

    path = node.base / ".slurm-ckpt" / "ledger.json"
    entries = json.loads(path.read_text())
    entries[job_id]["since"] = 0
    path.write_text(json.dumps(entries))


def _mounts_under(path: Path) -> list[str]:
    from slurm_ckpt.node.mounts import table

    return [f"{m.fstype} on {m.point}" for m in table() if m.point.startswith(str(path))]


def test_a_dead_fuse_daemon_on_the_job_dir(node: Node, user: User, other_user: User) -> None:
    """The user mounts FUSE on their own job dir with fusermount3, as themselves; its daemon
    dies with the job. Root's every call there fails (EACCES: not allow_other; ENOTCONN: no
    daemon). The other user's prolog still gets scratch, and the epilog detaches the mount,
    removes the scratch and releases its reservation."""
    assert node.run("prolog", user, "731")[0] == 0, node.log()
    with dead_fuse_of(user, node.scratch("731")) as how:
        print("FUSE mounted by", how)
        assert [m.split()[0] for m in _mounts_under(node.scratch("731"))] == ["ext4", "fuse"]
        with pytest.raises(PermissionError):
            os.stat(node.scratch("731"))
        _age(node, "731")
        assert node.run("prolog", other_user, "732")[0] == 0, node.log()
        assert _ledger(node)["732"]["size"] == 64 * 2**20 and node.scratch("732").is_dir()
        assert node.run("epilog", user, "731")[0] == 0, node.log()
        assert _mounts_under(node.scratch("731")) == []
        assert "731" not in _ledger(node) and not node.scratch("731").exists()
        assert "detached a mount the hooks did not make" in node.log()
    assert node.run("epilog", other_user, "732")[0] == 0, node.log()
    assert _ledger(node) == {}


def test_an_allow_other_fuse_answering_eio_fails_no_other_prolog(node: Node, user: User, other_user: User,
                                                                 pub_tmp: Path) -> None:  # fmt: skip
    """A live FUSE daemon mounted allow_other on the user's job dir answers EIO to every call,
    root's too. EIO from scratch would be a node fault (exit 12, a drained node) if the hooks
    followed the mount; they do not.

    The daemon runs as root with allow_other: an ordinary user's fusermount3 allows that
    only with user_allow_other in /etc/fuse.conf, a machine-wide setting this test leaves
    alone. What the hooks see is the same: a mount they did not make, answering EIO."""
    assert node.run("prolog", user, "733")[0] == 0, node.log()
    work = pub_tmp / "fuse-eio"
    with mount_faultfs(work / "root", node.scratch("733"), work / "ctl.sock",
                       options=("allow_other", "nonempty", "attr_timeout=0", "entry_timeout=0")) as fs:  # fmt: skip
        fs.set({"op": "*", "errno": "EIO"})
        with pytest.raises(OSError, match="Input/output error"):
            os.listdir(node.scratch("733"))  # root's calls reach the daemon, which fails them
        _age(node, "733")
        assert node.run("prolog", other_user, "734")[0] == 0, node.log()
        assert _ledger(node)["734"]["size"] == 64 * 2**20 and node.scratch("734").is_dir()
        assert node.run("epilog", user, "733")[0] == 0, node.log()
        assert _mounts_under(node.scratch("733")) == []
        assert "733" not in _ledger(node) and not node.scratch("733").exists()
        fs_left = fs.root
    assert fs_left.is_dir()  # the daemon's own files were never touched
    assert node.run("epilog", other_user, "734")[0] == 0, node.log()


def _hold_in_userns(user: User, path: Path) -> subprocess.Popen[str]:
    """A process of ``user`` in its own user and mount namespace (``unshare -Urm``), cwd in
    ``path``: that namespace has its own copy of every mount, the job's loop filesystem too."""
    from tests.node.helpers import PATH

    if user.run("unshare", "-Urm", "true", check=False).returncode:
        pytest.skip("unprivileged user namespaces are off on this kernel")
    p = subprocess.Popen(["unshare", "-Urm", "sh", "-c", 'cd "$1" && echo ready && exec sleep 600', "sh", str(path)],
                         user=user.uid, group=user.gid, extra_groups=[], cwd="/", env={"PATH": PATH},
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _end(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.wait(timeout=30)


def _until(what: str, cond: Any, timeout: float = 30) -> None:
    """Wait for the kernel to let a loop device go after its last mount namespace died:
    that happens in the kernel's own time, with nothing to wait on but polling."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_user_namespace_holding_the_loop_fs_keeps_it_reserved(node: Node, user: User,
                                                                 other_user: User) -> None:  # fmt: skip
    """Another job of the user holds the job's loop filesystem from its own user and mount
    namespace. The epilog's umount succeeds, but the device and the image's blocks stay: the
    reservation stays too (in the graveyard), until the device lets go."""
    from slurm_ckpt.node.graveyard import reap

    node.write_config(scratch={"over_reserve": "none"})
    assert node.run("prolog", user, "741", SLURM_JOB_COMMENT="ckpt_scratch=400M")[0] == 0, node.log()
    holder = _hold_in_userns(user, node.scratch("741"))
    try:
        assert node.run("epilog", user, "741")[0] == 0, node.log()
        graves = {k: e for k, e in _ledger(node).items() if k.startswith("grave/")}
        assert [(e["job"], e["size"]) for e in graves.values()] == [("741", 400 * 2**20)]
        assert "still holds its image" in node.log()
        assert node.run("prolog", other_user, "742", SLURM_JOB_COMMENT="ckpt_scratch=200M")[0] == 0
        assert "742" not in _ledger(node) and "No space left" not in node.log()  # refused up front
    finally:
        _end(holder)
    _until("the image to be reaped", lambda: reap(str(node.base), 86400, 60, wait=True) and _ledger(node) == {})
    assert node.run("prolog", other_user, "743", SLURM_JOB_COMMENT="ckpt_scratch=200M")[0] == 0
    assert _ledger(node)["743"]["size"] == 200 * 2**20
    assert node.run("epilog", other_user, "743")[0] == 0


def test_a_leaked_loop_device_is_counted_by_the_next_prolog(node: Node, user: User, other_user: User) -> None:
    """An image unlinked while a user's namespace still held its filesystem (what an epilog
    that trusted its umount did): no name, no reservation, but 400 MiB of blocks. The next
    prolog counts the device's space as taken instead of promising it to another job."""
    node.write_config(scratch={"over_reserve": "none"})
    assert node.run("prolog", user, "744", SLURM_JOB_COMMENT="ckpt_scratch=400M")[0] == 0, node.log()
    holder = _hold_in_userns(user, node.scratch("744"))
    try:
        sh("umount", str(node.scratch("744")))
        (node.base / ".slurm-ckpt" / "img" / "job_744.img").unlink()
        node.scratch("744").rmdir()
        (node.base / ".slurm-ckpt" / "ledger.json").write_text("{}")
        assert node.run("prolog", other_user, "745", SLURM_JOB_COMMENT="ckpt_scratch=200M")[0] == 0
        leaks = {k: e["size"] for k, e in _ledger(node).items() if k.startswith("leak/")}
        assert list(leaks.values()) == [400 * 2**20] and "745" not in _ledger(node)
        assert "No space left" not in node.log()
    finally:
        _end(holder)

    def freed() -> bool:
        assert node.run("prolog", other_user, "746", SLURM_JOB_COMMENT="ckpt_scratch=200M")[0] == 0
        return "746" in _ledger(node)

    _until("the leaked device to go", freed)
    assert not any(k.startswith("leak/") for k in _ledger(node))
    assert node.run("epilog", other_user, "746")[0] == 0


def test_a_loop_device_of_a_jobs_own_file_is_not_a_leak(node: Node, user: User, other_user: User) -> None:
    """A job loop-mounts an image file in its scratch (as a container runtime does with a SIF
    file): that space is already the job's reservation, so the next prolog does not count it
    a second time as a leak."""
    node.write_config(scratch={"over_reserve": "none", "enforce": "none"})
    assert node.run("prolog", user, "747", SLURM_JOB_COMMENT="ckpt_scratch=200M")[0] == 0, node.log()
    inside = node.scratch("747") / "container.sif"
    user.run("truncate", "-s", "64M", str(inside))
    device = sh("losetup", "-f", "--show", str(inside)).stdout.strip()
    try:
        assert node.run("prolog", other_user, "748", SLURM_JOB_COMMENT="ckpt_scratch=200M")[0] == 0
        assert "748" in _ledger(node) and not any(k.startswith("leak/") for k in _ledger(node)), _ledger(node)
    finally:
        sh("losetup", "-d", device)
    for job, u in (("748", other_user), ("747", user)):
        assert node.run("epilog", u, job)[0] == 0, node.log()


def test_cleanup_unmounts_before_it_removes() -> None:
    """A kept loop image still mounted below a tree that the test cleanup removes, at a name
    mountinfo escapes (a space), held busy: it is detached, never walked; its files stay."""
    import tempfile

    from tests.node.helpers import need_root, remove_tree

    need_root()
    top = Path(tempfile.mkdtemp(prefix="sckt-", dir="/tmp"))
    mnt, img = top / "job_9 kept" / "scratch", top / "kept.img"
    mnt.mkdir(parents=True)
    sh("truncate", "-s", "16M", str(img))
    sh("mkfs.ext4", "-q", "-F", str(img))
    sh("mount", "-o", "loop", str(img), str(mnt))
    (mnt / "ckpt").write_text("the only copy")
    held = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)  # busy: the umount must fall back to a lazy one
    try:
        remove_tree(top)
        assert not top.exists()
        with open(os.open("ckpt", os.O_RDONLY, dir_fd=held)) as f:
            assert f.read() == "the only copy"
    finally:
        os.close(held)  # the detached filesystem and its loop device go with the last reference
        sh("umount", "-l", str(mnt), check=False)


def test_every_attack_at_once_stays_clear_of_the_watchdog(node: Node, user: User, other_user: User) -> None:
    """Metrics names, a stage-out hung on the user's FUSE mount, a dead FUSE mount on the job
    dir, scratch filled to its inode limit and a user namespace holding the loop filesystem, in one
    job: the epilog (config: 240 s; watchdog: 15 s) ends before the watchdog, exit 0."""
    node.settings(SLURM_CKPT_EPILOG_WATCHDOG="15")
    assert node.run("prolog", user, "751")[0] == 0, node.log()
    scratch = node.scratch("751")
    write_ckpt(fast_dir(scratch), 5, owner=user)
    user.run("/bin/sh", "-c", 'cd "$1" && mkdir many && cd many && seq 1 900 | xargs touch', "sh", str(scratch))
    user.run("/bin/sh", "-c", 'cd "$1" && seq -f "slurm_ckpt_751_%gx.prom" 1 20000 | xargs touch', "sh",
             str(node.prom))  # fmt: skip
    durable = node.root / user.name / "job_751"
    owned_tree(durable, user)
    holder = _hold_in_userns(user, scratch)
    try:
        with fuse_of(user, durable, hung=True), dead_fuse_of(user, scratch):
            rc, took = node.run("epilog", user, "751")
    finally:
        _end(holder)
    print(f"epilog with every attack at once: {took:.2f} s wall, watchdog 15 s ({took / 15:.2f} of it)")
    assert rc == 0 and took < 15, node.log()
    assert "keeping scratch" in node.log()  # the stage-out timed out: the only copy stays
