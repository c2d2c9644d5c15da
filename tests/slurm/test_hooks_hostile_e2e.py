"""Stage-out attacks of ordinary users, from inside their own jobs, under the real local Slurm.

slurmd runs the hooks as scripts/install-hooks.sh installs them. Two users
without privileges submit jobs through sbatch; the jobs do what a job can:

* a job leaves a checkpoint on scratch and 20000 ``slurm_ckpt_<job>_*.prom``
  names in the textfile dir (mode 1777); another job of the same user, running
  beside it, waits (inotify) until the epilog's stage-out writes in its
  durable run dir, then renames the stage-out's temp dir away and puts a link
  to the node's memory at its name;
* likewise, with a 1 TiB sparse file renamed over a checkpoint file of the
  job's scratch while the stage-out copies;
* the other user makes ``<root>/<user>/job_<id>`` of a job not yet started
  (the root is 1777), with a newer checkpoint in it.

The node stays up, each epilog exits 0 within its deadline, nothing lands in
/dev/shm, no step dir is a link, no refused copy is left in the run dir and
nothing past a manifest's sizes is written; refused stage-outs keep the job's
scratch, and the squatted checkpoint replaces nothing.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.harness import Cluster, Job
from tests.slurm.test_hooks_e2e import install_hooks

pytestmark = [pytest.mark.slurm, pytest.mark.root]


LEAVE = """\
import os, subprocess, sys, zlib
from pathlib import Path
from slurm_ckpt.store.commit import commit
from slurm_ckpt.store.tensorfile import FileRecord

job, files, traps = os.environ["SLURM_JOB_ID"], int(sys.argv[1]), sys.argv[2:]
scratch = Path(os.environ["SLURM_CKPT_SCRATCH"])

def write(tmp):
    recs = {}
    for i in range(files):
        data = os.urandom(8 << 20)
        with open(tmp / f"blob{i}.bin", "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
        recs[f"blob{i}.bin"] = FileRecord(len(data), f"{zlib.crc32(data):08x}")
    return recs, {}

(scratch / "ckpt").mkdir()
commit(scratch / "ckpt", 3, write)
if "sparse" in traps:
    os.truncate(os.open(scratch / "sparse", os.O_WRONLY | os.O_CREAT, 0o600), 1 << 40)
if "prom" in traps:  # names the epilog's metrics cleanup once walked, past the watchdog
    names = "\\n".join(f"slurm_ckpt_{job}_{i}x.prom" for i in range(20000))
    subprocess.run(["xargs", "touch"], input=names, text=True, cwd=traps[-1], check=True)
print("left", flush=True)
"""

SPRING = """\
import ctypes, os, struct, sys
from pathlib import Path

run, how, arg = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
IN_CREATE = 0x100
ino = libc.inotify_init1(os.O_CLOEXEC)
run.mkdir(parents=True)  # the job's own run dir, made ahead: the stage-out writes into it
assert libc.inotify_add_watch(ino, bytes(run), IN_CREATE) >= 0

def created():
    buf = os.read(ino, 65536)
    while buf:
        wd, _, _, n = struct.unpack_from("iIII", buf)
        yield wd, buf[16 : 16 + n].rstrip(b"\\0").decode()
        buf = buf[16 + n :]

print("watching", flush=True)
tmp = None
while tmp is None:
    tmp = next((run / n for _, n in created() if n.startswith(".tmp-step-")), None)
# Until the copy's first file: the copy is under way, its last file not yet reached.
wd = libc.inotify_add_watch(ino, bytes(tmp), IN_CREATE)
while not os.listdir(tmp) and not any(w == wd for w, _ in created()):
    pass
if how == "link":  # arg: a dir in the node's memory
    os.rename(tmp, run / "moved-away")
    os.symlink(arg, tmp)
else:  # arg: the job's scratch
    os.rename(arg / "sparse", arg / "ckpt" / "step-000000003" / "blob7.bin")
print("sprung", flush=True)
"""

SQUAT = """\
import sys
from pathlib import Path
from slurm_ckpt.store import RunDir
from slurm_ckpt.store.codec import encode_state
from slurm_ckpt.store.writer import write_state

Path(sys.argv[1]).mkdir(parents=True)
rd = RunDir(Path(sys.argv[1]))
enc = encode_state({"step": 99, "owner": "squatter"})
rd.commit(99, lambda tmp: write_state(tmp, enc), nbytes=enc.nbytes)
rd.unlock()
print("squatted", flush=True)
"""


def _add_user() -> pwd.struct_passwd:
    name = f"sckt{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    return pwd.getpwnam(name)


@pytest.fixture
def two_users() -> Iterator[tuple[pwd.struct_passwd, pwd.struct_passwd]]:
    made: list[str] = []
    try:
        for _ in range(2):
            made.append(_add_user().pw_name)
        yield pwd.getpwnam(made[0]), pwd.getpwnam(made[1])
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True, timeout=60)


def _epilog_ms(log: Path, job: Job) -> int | None:
    m = re.search(rf"job {job.id}: INFO: epilog done in (\d+) ms", log.read_text())
    return int(m.group(1)) if m else None


def _bytes_under(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*"))


def test_stage_out_attacks_of_an_ordinary_user_under_slurm(
    slurm_cluster: Cluster, slurm_workdir: Path, two_users: tuple[pwd.struct_passwd, pwd.struct_passwd]
) -> None:
    user, other = two_users
    node = slurm_cluster.node_names[0]
    base = slurm_cluster.scratch / "slurm-ckpt"
    root, prom, hooks = slurm_workdir / "root", slurm_workdir / "prom", slurm_workdir / "hooks"
    install_hooks(hooks, base, root)
    root.mkdir()
    root.chmod(0o1777)  # world-writable, as some sites make it: anyone may make <root>/<user>
    prom.mkdir()
    prom.chmod(0o1777)  # as the config template says for node_exporter's textfile dir
    with open(hooks.with_name("config.yaml"), "a") as f:
        f.write(f"metrics:\n  textfile_dir: {prom}\n")
    jobdir = slurm_workdir / "jobs"
    jobdir.mkdir()
    jobdir.chmod(0o1777)
    for name, text in (("leave.py", LEAVE), ("spring.py", SPRING), ("squat.py", SQUAT)):
        (jobdir / name).write_text(text)
    memory = Path(f"/dev/shm/{user.pw_name}-memory")
    slurm_cluster.configure({"Prolog": str(hooks / "slurm-ckpt-prolog"), "Epilog": str(hooks / "slurm-ckpt-epilog"),
                             "TaskProlog": str(hooks / "slurm-ckpt-taskprolog"), "PrologFlags": "Alloc",
                             "PrologEpilogTimeout": 60})  # fmt: skip
    log = hooks / "hooks.log"
    took: dict[str, int] = {}

    def submit(pw: pwd.struct_passwd, body: str, name: str, *options: str) -> Job:
        return slurm_cluster.sbatch(f"srun {sys.executable} {body}\n", f"--uid={pw.pw_name}",
                                    f"--gid={pw.pw_name}", *options, workdir=jobdir, name=name)  # fmt: skip

    def attacked(files: int, traps: str, how: str, name: str) -> tuple[Job, Path, str]:
        """A job of ``user`` that leaves ``files`` x 8 MiB on scratch, with its other job springing ``how``."""
        job = submit(user, f"leave.py {files} {traps}", name, "--hold", f"--comment=ckpt_scratch={files * 12}M")
        run = root / user.pw_name / f"job_{job.id}"
        arg = memory if how == "link" else base / f"job_{job.id}"
        spring = submit(user, f"spring.py {run} {how} {arg}", f"{name}-spring")
        spring.wait_output("watching", timeout=90)
        slurm_cluster.run("scontrol", "release", job.id)
        job.wait_state("COMPLETED", timeout=90)
        spring.wait_output("sprung", timeout=60)
        return job, run, ended(job, name)

    def ended(job: Job, name: str) -> str:
        """The hooks' log once ``job``'s epilog is done: within its deadline, and the node still up."""
        job.wait_for("its epilog", lambda r: _epilog_ms(log, job) is not None, 60)
        took[name] = ms = _epilog_ms(log, job) or 0
        assert ms < 40_000, log.read_text()  # scratch.epilog_timeout, itself below the watchdog
        state = slurm_cluster.node_state(node).upper()
        assert "DRAIN" not in state and not state.startswith(("DOWN", "FAIL")), state
        return log.read_text()

    try:
        in_memory = slurm_cluster.on_node(node, memory)  # the node's /dev/shm, as its jobs see it
        in_memory.mkdir()
        os.chown(in_memory, user.pw_uid, user.pw_gid)
        # Findings 3, 4 (and 1): the temp dir swapped for a link to node memory while the stage-out writes.
        job, run, text = attacked(4, f"prom {prom}", "link", "link")
        assert os.listdir(in_memory) == [], "the stage-out wrote into node memory"
        assert (run / "moved-away").is_dir()  # the attack ran
        assert os.listdir(run / "moved-away") == [], "the refused copy was left in the run dir"
        assert not list(run.glob("step-*")), os.listdir(run)  # no step dir, no link at one
        assert f"job {job.id}: INFO: stage-out failed" in text and "something else put in its place" in text, text
        kept = slurm_cluster.on_node(node, base / f"job_{job.id}" / "ckpt" / "step-000000003")
        assert sorted(os.listdir(kept)) == ["MANIFEST.json"] + [f"blob{i}.bin" for i in range(4)]
        assert f"job {job.id}: ERROR: keeping scratch" in text, text
        assert len(list(prom.glob(f"slurm_ckpt_{job.id}_*x.prom"))) == 20000  # the user's names, left alone

        # Finding 5: 1 TiB of holes renamed over a file of the checkpoint while the stage-out copies.
        job, run, text = attacked(8, "sparse", "sparse", "sparse")
        staged = run / "step-000000003"
        if staged.exists():  # the copy held the file open before the rename: a true copy
            assert (staged / "blob7.bin").stat().st_size == 8 << 20
        else:
            assert "size is 1099511627776, manifest expects 8388608" in text, text
        assert _bytes_under(run) <= (64 << 20) + (1 << 20), "the stage-out wrote past the manifest's sizes"

        # Finding 8: the other user squats the run dir of the user's next job before it starts.
        victim = submit(other, "leave.py 1", "victim", "--hold")
        squatted = root / other.pw_name / f"job_{victim.id}"
        submit(user, f"squat.py {squatted}", "squat").wait_state("COMPLETED", timeout=90)
        assert (squatted / "step-000000099").is_dir()
        slurm_cluster.run("scontrol", "release", victim.id)
        victim.wait_state("COMPLETED", timeout=90)
        text = ended(victim, "squat")
        assert f"owned by uid {user.pw_uid}, not by the job's user" in text, text
        assert f"job {victim.id}: INFO: stage-out failed" in text and "up-to-date" not in text, text
        assert [p.name for p in squatted.glob("step-*")] == ["step-000000099"], os.listdir(squatted)
        mine = slurm_cluster.on_node(node, base / f"job_{victim.id}" / "ckpt" / "step-000000003")
        assert (mine / "MANIFEST.json").is_file(), "the victim's only copy was removed"
        print(f"\nepilog wall time per attack (epilog_timeout 40 s, watchdog 50 s): {took} ms")
    finally:
        shutil.rmtree(slurm_cluster.on_node(node, memory), ignore_errors=True)
