"""The forked user child's memory bound, against the process that forks it.

The epilog forks the stage-out child from whatever process runs the hook; in
the tests (and in any host that embeds the hooks) that process already maps
gigabytes of address space: libraries, thread stacks, malloc arenas. The
child's bound must count from there, and a child that runs out of memory must
keep the job's scratch, never take the checkpoint for a corrupt one.

Real unprivileged user, real fork and setrlimit, real checkpoints.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_ckpt.node import run_epilog, run_prolog, userchild
from slurm_ckpt.node.job import Job
from slurm_ckpt.store import verify_checkpoint
from tests.node.helpers import User, make_cfg, owned_tree, write_ckpt

GiB = 2**30
# Address space without a claim on memory (Python 3.11's mmap does not name the Linux flag).
NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | NORESERVE


@pytest.fixture
def big_parent() -> Iterator[int]:
    """This process maps more address space than the child's whole bound (never touched, so no memory)."""
    size = userchild.CHILD_MEMORY + 2 * GiB
    reserved = mmap.mmap(-1, size, flags=ANON, prot=mmap.PROT_READ)
    try:
        yield size
    finally:
        reserved.close()


def job_of(user: User) -> Job:
    return Job(job_id="900", uid=user.uid, gid=user.gid, user=user.name, home="/", partition="p", comment="",
               restart_count=0)  # fmt: skip


def try_to_map(nbytes: int) -> bytes:
    try:
        m = mmap.mmap(-1, nbytes, flags=ANON)
    except OSError:
        return b"refused"
    m.close()
    return b"mapped"


def test_the_child_can_allocate_under_a_parent_larger_than_its_bound(user: User, big_parent: int) -> None:
    out = userchild.run_as_user(job_of(user), lambda: try_to_map(64 * 2**20), 30.0, name="probe")
    assert out.result == b"mapped", out


def test_the_child_cannot_map_more_than_its_bound(user: User, big_parent: int) -> None:
    """What user data can make the child allocate stays bounded however much the parent maps."""
    over = userchild.run_as_user(job_of(user), lambda: try_to_map(userchild.CHILD_MEMORY + GiB), 30.0, name="probe")
    assert over.result == b"refused", over
    within = userchild.run_as_user(job_of(user), lambda: try_to_map(userchild.CHILD_MEMORY // 2), 30.0, name="probe")
    assert within.result == b"mapped", within


def test_the_stage_out_works_under_a_parent_larger_than_its_bound(pub_tmp: Path, scratch_base: Path, user: User,
                                                                  big_parent: int) -> None:  # fmt: skip
    root = pub_tmp / "shared"
    owned_tree(root / user.name, user)
    cfg = make_cfg(scratch_base, root)
    env = user.env("901")
    run_prolog(env, cfg)
    write_ckpt(scratch_base / "job_901" / "ckpt", 6, owner=user)
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "staged", res
    verify_checkpoint(Path(res.path or ""), full=True)


def test_a_child_out_of_memory_keeps_scratch(pub_tmp: Path, scratch_base: Path, user: User,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The child runs out of memory while it screens the checkpoint: the stage-out fails and
    the checkpoint stays on scratch for a rerun. Out of memory is no sign of a corrupt
    checkpoint; passing it over would let scratch go.

    Faked: under the real limit, which allocation fails first depends on the free heap
    the child inherits from the fork (a reused free chunk maps nothing new), so the
    MemoryError is raised where the screen checks a checkpoint's headers.
    """
    from slurm_ckpt import store

    def exhausted(path: Path, full: bool = True) -> None:
        raise MemoryError

    monkeypatch.setattr(store, "verify_checkpoint", exhausted)  # in the forked child too
    root = pub_tmp / "shared"
    owned_tree(root / user.name, user)
    cfg = make_cfg(scratch_base, root)
    env = user.env("902")
    run_prolog(env, cfg)
    ckpt = write_ckpt(scratch_base / "job_902" / "ckpt", 8, owner=user)
    res = run_epilog(env, cfg)
    assert res is not None and res.status == "failed" and "MemoryError" in res.detail, res
    monkeypatch.undo()
    verify_checkpoint(ckpt, full=True)
    assert not (root / user.name / "job_902").exists()


def test_a_small_file_costs_the_child_its_size_not_its_limit(pub_tmp: Path, user: User,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The screens read manifests and JSON files with a limit of up to 1 GiB: reading a
    100-byte one must not ask for the limit's worth of memory first."""
    from slurm_ckpt.store.fsutil import read_small

    small = pub_tmp / "small.json"
    small.write_text('{"x": 1}' + " " * 92)
    monkeypatch.setattr(userchild, "CHILD_MEMORY", 64 * 2**20)
    out = userchild.run_as_user(job_of(user), lambda: read_small(small, GiB)[:8], 30.0, name="probe")
    assert out.result == b'{"x": 1}', out


def test_a_file_past_the_childs_file_size_bound_fails_without_killing_it(user: User, pub_tmp: Path) -> None:
    """Whatever path a write takes, a file grows no larger than ``file_size``: EFBIG, and the child reports it."""
    import errno
    import os

    d = pub_tmp / "mine"
    owned_tree(d, user)

    def write_past() -> bytes:
        fd = os.open(d / "big", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"x" * 2**20)
            os.write(fd, b"x")
        except OSError as e:
            return errno.errorcode[e.errno or 0].encode()
        finally:
            os.close(fd)
        return b"wrote"

    out = userchild.run_as_user(job_of(user), write_past, 30.0, name="probe", file_size=2**20)
    assert out.result == b"EFBIG" and (d / "big").stat().st_size == 2**20, out
