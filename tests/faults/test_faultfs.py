"""The fault-injecting filesystem itself: rules fire where, when and how often they say."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.faultfs import FaultFS
from tests.faultfs.rules import Injector


def test_rule_matching_after_count_and_seeded_probability() -> None:
    inj = Injector()
    inj.set([{"op": ["write"], "path": "*/tensors-*", "errno": "EIO", "after": 2, "count": 3}])
    got = [inj.check("write", f"/run/.tmp/tensors-{i}").errno for i in range(7)]
    assert got == [0, 0, errno.EIO, errno.EIO, errno.EIO, 0, 0]
    assert inj.check("write", "/run/state.json").errno == 0 and inj.check("fsync", "/run/tensors-0").errno == 0
    inj.set([{"op": "*", "errno": "ENOSPC", "prob": 0.3}], seed=11)
    first = [inj.check("create", "/x").errno for _ in range(200)]
    inj.set([{"op": "*", "errno": "ENOSPC", "prob": 0.3}], seed=11)
    assert [inj.check("create", "/x").errno for _ in range(200)] == first  # reproducible
    assert 30 < first.count(errno.ENOSPC) < 90
    stats = inj.stats()
    assert stats["rules"][0]["fired"] == first.count(errno.ENOSPC) and stats["calls"]["create"] == 200


def test_bad_rules_are_refused_over_the_socket(faultfs: FaultFS) -> None:
    for bad in ({"op": "writ", "errno": "EIO"}, {"op": "write"}, {"op": "write", "errno": "ENOTANERRNO"},
                {"op": "write", "errno": "EIO", "colour": "red"}):  # fmt: skip
        with pytest.raises(ValueError, match="faultfs rejected"):
            faultfs.set(bad)
    faultfs.clear()


def test_real_syscalls_see_injected_errors(faultfs: FaultFS, fault_dir: Path) -> None:
    f = fault_dir / "data"
    with faultfs.faults({"op": "write", "path": f"/{fault_dir.name}/data", "errno": "EDQUOT"}):
        fd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with pytest.raises(OSError) as ei:
                os.write(fd, b"x" * 10)
        finally:
            os.close(fd)
    assert ei.value.errno == errno.EDQUOT
    with faultfs.faults({"op": "write", "short": True}):
        fd = os.open(f, os.O_WRONLY)
        try:
            assert os.write(fd, b"y" * 1000) == 500  # the kernel passes the short count through
        finally:
            os.close(fd)
    assert (faultfs.root / fault_dir.name / "data").read_bytes() == b"y" * 500
    with faultfs.faults({"op": "fsync", "errno": "EIO", "count": 1}):
        fd = os.open(f, os.O_WRONLY)
        try:
            with pytest.raises(OSError, match="Input/output error"):
                os.fsync(fd)
            os.fsync(fd)  # count 1: the next one passes
        finally:
            os.close(fd)
