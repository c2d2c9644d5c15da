"""The epilog's stage-out against a user who changes the durable run dir while it copies,
and against another user who got into that dir first.

Real unprivileged users, scratch on its own tmpfs with per-job loop filesystems,
durable run dirs on the test's temp filesystem or on a loop filesystem of their own.
An attack that must land between two steps of the copy runs at a hook point: the
commit's write step (``copy_files``) or its manifest write, called in the stage-out
child after the temp dir was made, as the job's user. That is what another node of
the same user can do at that moment on shared storage; the test only picks the moment.
The other attacks go through the shims, as slurmd runs them.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt.node import run_epilog, run_prolog
from slurm_ckpt.store import commit as commit_mod
from slurm_ckpt.store import transfer
from slurm_ckpt.store.layout import list_steps
from slurm_ckpt.store.tensorfile import FileRecord
from tests.node.helpers import (
    User,
    craft_ckpt,
    install_hooks,
    make_cfg,
    owned_tree,
    run_shim,
    sh,
    write_ckpt,
    write_config,
)

MiB = 2**20
BIN = Path(sys.executable).with_name("slurm-ckpt")


@pytest.fixture
def node_memory(pub_tmp: Path) -> Iterator[Path]:
    """A tmpfs of 8 MiB standing in for the node's /dev/shm (mode 1777), unmounted afterwards."""
    mnt = pub_tmp / "shm"
    mnt.mkdir()
    sh("mount", "-t", "tmpfs", "-o", "size=8m,mode=1777", "sckt-shm", str(mnt))
    yield mnt
    sh("umount", "-l", str(mnt), check=False)


def _before(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, attack: Callable[[], None]) -> None:
    """Run ``attack`` (in the stage-out child, as the user) once, before ``module.name`` runs."""
    # Modules that bind the name at import (the shard staging's copy_files) must bind the real
    # one: the stage-out imports them during the test, and they would keep the hook for good.
    import slurm_ckpt.store.shards.staging  # noqa: F401

    real = getattr(module, name)
    done: list[bool] = []

    def hooked(*args: Any, **kw: Any) -> Any:
        if not done:
            done.append(True)
            attack()
        return real(*args, **kw)

    monkeypatch.setattr(module, name, hooked)


@pytest.mark.parametrize("when", ["before the data", "before the manifest"])
def test_a_temp_dir_swapped_for_a_link_to_node_memory_gets_no_byte(
    pub_tmp: Path, scratch_base: Path, user: User, node_memory: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    root = pub_tmp / "shared"
    owned_tree(root / user.name, user)
    cfg = make_cfg(scratch_base, root)
    env = user.env("61", SLURM_JOB_COMMENT="ckpt_scratch=64M")
    run_prolog(env, cfg)
    job = scratch_base / "job_61"
    write_ckpt(job / "ckpt", 3, nbytes=16 * MiB, owner=user)
    durable = root / user.name / "job_61"
    target = node_memory / user.name
    user.run("mkdir", str(target))

    def swap() -> None:
        # The user's other node: the temp dir renamed away, a link to node memory at its name.
        tmp = next(p for p in durable.iterdir() if p.name.startswith(".tmp-step-"))
        os.rename(tmp, durable / "moved-away")
        os.symlink(target, tmp)

    if when == "before the data":
        _before(monkeypatch, transfer, "copy_files", swap)
    else:
        _before(monkeypatch, commit_mod, "write_file_durably", swap)
    free = os.statvfs(node_memory).f_bfree
    res = run_epilog(env, cfg)
    assert (durable / "moved-away").is_dir()  # the attack ran
    assert os.listdir(durable / "moved-away") == []  # the copy in it removed, through the temp dir's fd
    # Not a byte in node memory; no step dir that is a link; scratch kept, as the copy was not committed.
    assert os.listdir(target) == [] and os.statvfs(node_memory).f_bfree == free
    assert not (durable / "step-000000003").is_symlink() and list_steps(durable) == []
    assert res is not None and res.status == "failed" and "something else put in its place" in res.detail, res
    assert f"{durable}/step-000000003" in res.detail and "/proc/self/fd" not in res.detail
    assert (job / "ckpt" / "step-000000003").is_dir()


def test_a_temp_dir_replaced_by_a_link_before_it_is_opened_is_refused(
    pub_tmp: Path, scratch_base: Path, user: User, node_memory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link lands between the temp dir's mkdir and its open: the open refuses it (O_NOFOLLOW)."""
    root = pub_tmp / "shared"
    owned_tree(root / user.name, user)
    cfg = make_cfg(scratch_base, root)
    env = user.env("63", SLURM_JOB_COMMENT="ckpt_scratch=64M")
    run_prolog(env, cfg)
    job = scratch_base / "job_63"
    write_ckpt(job / "ckpt", 3, nbytes=MiB, owner=user)
    durable = root / user.name / "job_63"
    target = node_memory / user.name
    user.run("mkdir", str(target))
    real_mkdir = os.mkdir

    def mkdir_then_swap(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(path, mode, dir_fd=dir_fd)
        name = os.fsdecode(path)
        if os.path.basename(name).startswith(".tmp-step-"):
            away = "moved-away" if dir_fd is not None else os.path.join(os.path.dirname(name), "moved-away")
            os.rename(name, away, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.symlink(target, name, dir_fd=dir_fd)

    monkeypatch.setattr(commit_mod.os, "mkdir", mkdir_then_swap)
    res = run_epilog(env, cfg)
    assert (durable / "moved-away").is_dir()
    assert os.listdir(target) == [] and list_steps(durable) == []
    assert res is not None and res.status == "failed" and "a symlink or file was put in place of the temp dir" in res.detail


def _loop_device(mnt: Path) -> str:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if fields[4] == str(mnt):
            return fields[fields.index("-") + 2]
    raise AssertionError(f"{mnt} is not mounted")


def test_a_sparse_file_renamed_over_a_screened_one_is_not_copied(
    pub_tmp: Path, scratch_base: Path, user: User, loop_fs: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 TiB of holes renamed over a 4 MiB checkpoint file after the screens: not a byte of it is written."""
    durable_fs = loop_fs("ext4", "64M")  # far less than the 1 TiB, far more than the 16 MiB reservation
    assert _loop_device(durable_fs).startswith("/dev/loop")
    owned_tree(durable_fs / user.name, user)
    cfg = make_cfg(scratch_base, durable_fs)
    env = user.env("62", SLURM_JOB_COMMENT="ckpt_scratch=16M")
    run_prolog(env, cfg)
    job = scratch_base / "job_62"
    step = craft_ckpt(job / "ckpt", 4, {"blob.bin": os.urandom(4 * MiB)}, owner=user)
    user.run("truncate", "-s", "1T", str(job / "sparse"))
    assert os.stat(job / "sparse").st_blocks == 0

    def swap() -> None:
        os.rename(job / "sparse", step / "blob.bin")

    _before(monkeypatch, transfer, "copy_files", swap)
    free = os.statvfs(durable_fs).f_bfree * os.statvfs(durable_fs).f_frsize
    res = run_epilog(env, cfg)
    assert res is not None and res.status != "staged", res
    assert "size is 1099511627776, manifest expects 4194304" in res.detail, res
    assert "No space" not in res.detail
    # Nothing written out: the durable filesystem lost at most a few blocks of dirs.
    assert free - os.statvfs(durable_fs).f_bfree * os.statvfs(durable_fs).f_frsize < MiB
    assert list_steps(durable_fs / user.name / "job_62") == []


def test_the_copy_writes_no_more_than_the_reservation(pub_tmp: Path, scratch_base: Path, user: User) -> None:
    """Hard links to one file cost scratch once, and would be written out once per name."""
    root = pub_tmp / "shared"
    owned_tree(root / user.name, user)
    cfg = make_cfg(scratch_base, root)
    env = user.env("64", SLURM_JOB_COMMENT="ckpt_scratch=16M")
    run_prolog(env, cfg)
    ckpt = scratch_base / "job_64" / "ckpt"
    data = os.urandom(4 * MiB)
    names = [f"{c}.bin" for c in "abcdef"]  # 24 MiB to write out, 4 MiB stored

    def write(tmp: Path) -> tuple[dict[str, FileRecord], dict[str, Any]]:
        (tmp / names[0]).write_bytes(data)
        for name in names[1:]:
            os.link(tmp / names[0], tmp / name)
        return dict.fromkeys(names, FileRecord(len(data), f"{zlib.crc32(data):08x}")), {}

    ckpt.mkdir()
    commit_mod.commit(ckpt, 2, write)
    sh("chown", "-R", f"{user.uid}:{user.gid}", str(ckpt))
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "failed" and "pass the" in res.detail and "reservation" in res.detail
    assert list_steps(root / user.name / "job_64") == []


@pytest.fixture
def hooks(pub_tmp: Path, scratch_base: Path) -> Path:
    """The shims installed with scripts/install-hooks.sh; durable run dirs under ``pub_tmp/shared``."""
    config = write_config(pub_tmp / "config.yaml", scratch_base, pub_tmp / "shared")
    return install_hooks(pub_tmp / "hooks", config, BIN)


@pytest.mark.parametrize("where", ["root 1777", "root 0777", "user dir 0777", "step"])
def test_a_run_dir_squatted_by_another_user_is_refused_and_scratch_kept(
    pub_tmp: Path, scratch_base: Path, hooks: Path, user: User, other_user: User, where: str
) -> None:
    """Another user makes ``<root>/<user>/job_<id>`` first and plants a newer checkpoint there."""
    root = pub_tmp / "shared"
    root.mkdir()
    squat = root / user.name / "job_71"
    if where.startswith("root"):
        root.chmod(int(where.split()[1], 8))
        other_user.run("mkdir", "-p", str(squat))
        write_ckpt(squat, 99, owner=other_user)
    elif where == "user dir 0777":
        owned_tree(root / user.name, user)
        (root / user.name).chmod(0o777)  # e.g. a umask 000 somewhere in the user's setup
        other_user.run("mkdir", str(squat))
        write_ckpt(squat, 99, owner=other_user)
    else:  # the run dir is the user's, but a checkpoint in it is another user's
        owned_tree(squat, user)
        write_ckpt(squat, 99, owner=user)
        sh("chown", "-R", f"{other_user.uid}:{other_user.gid}", str(squat / "step-000000099"))
    env = user.env("71")
    assert run_shim(hooks / "slurm-ckpt-prolog", env) == 0
    mine = write_ckpt(scratch_base / "job_71" / "ckpt", 5, owner=user)
    assert run_shim(hooks / "slurm-ckpt-epilog", env) == 0
    log = (hooks / "hooks.log").read_text()
    assert f"owned by uid {other_user.uid}, not by the job's user" in log or "writable by other users" in log, log
    assert "stage-out failed" in log and "up-to-date" not in log
    assert mine.is_dir()  # scratch kept: it holds the only copy of the user's checkpoint
    if where != "step":
        # The job's next run, on any node, does not resume the other user's state either.
        run = user.run(sys.executable, "-c", "from slurm_ckpt import Checkpointer; Checkpointer()", check=False,
                       env={"SLURM_JOB_ID": "71", "SLURM_CKPT_CONFIG": str(pub_tmp / "config.yaml")})  # fmt: skip
        assert run.returncode != 0 and f"will not use run dir {squat}" in run.stderr, run.stderr


def _private_interpreter(where: Path) -> Path:
    """slurm-ckpt installed in a venv under ``where`` (root's, mode 0700), as under root's home."""
    venv = where / "venv"
    sh(sys._base_executable, "-m", "venv", "--without-pip", str(venv))  # type: ignore[attr-defined]
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv)}))
    repo = Path(__file__).resolve().parents[2]
    shutil.copytree(repo / "slurm_ckpt", site / "slurm_ckpt", ignore=shutil.ignore_patterns("__pycache__"))
    import click
    import filelock
    import yaml

    for mod in (click, filelock, yaml):
        pkg = Path(mod.__file__ or "").parent
        shutil.copytree(pkg, site / pkg.name, ignore=shutil.ignore_patterns("__pycache__"))
    bin_ = venv / "bin" / "slurm-ckpt"
    bin_.write_text(f"#!{venv}/bin/python\nimport sys\nfrom slurm_ckpt.cli import main\nsys.exit(main())\n")
    bin_.chmod(0o755)
    return bin_


def test_the_stage_out_runs_from_an_installation_the_user_cannot_read(
    pub_tmp: Path, scratch_base: Path, user: User
) -> None:
    private = Path(tempfile.mkdtemp(prefix="sckt-root-"))  # root's, mode 0700
    try:
        assert os.stat(private).st_mode & 0o777 == 0o700 and os.stat(private).st_uid == 0
        bin_ = _private_interpreter(private)
        with pytest.raises(PermissionError):  # the user cannot even run it
            user.run(str(bin_), "--version")
        root = pub_tmp / "shared"
        owned_tree(root / user.name, user)
        hooks = install_hooks(pub_tmp / "hooks", write_config(pub_tmp / "config.yaml", scratch_base, root), bin_)
        env = user.env("72")
        assert run_shim(hooks / "slurm-ckpt-prolog", env) == 0
        write_ckpt(scratch_base / "job_72" / "ckpt", 6, owner=user)
        assert run_shim(hooks / "slurm-ckpt-epilog", env) == 0
        log = (hooks / "hooks.log").read_text()
        assert "stage-out staged" in log, log
        assert [s for s, _ in list_steps(root / user.name / "job_72")] == [6]
        assert not (scratch_base / "job_72").exists()
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _doctor_owners(path: Path, config: Path) -> list[dict[str, Any]]:
    import json
    import subprocess

    r = subprocess.run([str(BIN), "doctor", str(path), "--json", "--probe-size", "1M", "--probe-seconds", "1"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SLURM_CKPT_CONFIG": str(config), "SLURM_CONF": "/nonexistent"})  # fmt: skip
    return [f for f in json.loads(r.stdout)["findings"] if f["check"] == "owners"]


def test_doctor_flags_a_root_open_to_all_and_a_squatted_per_user_dir(
    pub_tmp: Path, scratch_base: Path, user: User, other_user: User
) -> None:
    root = pub_tmp / "shared"
    root.mkdir()
    config = write_config(pub_tmp / "config.yaml", scratch_base, root)
    owned_tree(root / other_user.name, other_user)
    (root / other_user.name).chmod(0o700)
    root.chmod(0o1777)
    assert [f["severity"] for f in _doctor_owners(root, config)] == ["ok"]
    root.chmod(0o777)
    other_user.run("mkdir", str(root / user.name))  # squatted: named after user, made by other_user
    found = _doctor_owners(root / user.name / "job_1", config)
    errors = [f["message"] for f in found if f["severity"] == "error"]
    assert any("writable by every user without the sticky bit" in m for m in errors), found
    assert any(f"per-user dir {root / user.name} is owned by uid {other_user.uid}" in m for m in errors), found
    assert any(m.startswith("the run dir cannot be used") for m in errors), found
