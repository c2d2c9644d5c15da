"""One storage lab (GlusterFS and CephFS, two mounts each) for the whole session.

It starts with the first test that asks for it and stops at the end of the
session, so the suite pays the start-up (about 15 s) once. Each test gets a
fresh directory on the filesystem it asks for. With ``STORAGE_LAB_REUSE=1``
the tests use a lab already up (``scripts/storage-lab.sh up``) and leave it up.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.storage import lab as lab_mod

pytestmark = pytest.mark.root


@pytest.fixture(scope="session")
def lab() -> Iterator[lab_mod.Lab]:
    if os.environ.get("STORAGE_LAB_REUSE") == "1" and lab_mod.NETNS.exists():
        yield lab_mod.Lab(lab_mod.LAB_DIR)
        return
    why = lab_mod.lab_missing()
    if why:
        pytest.skip(why)
    try:
        running = lab_mod.up()
    except Exception:
        lab_mod.down()
        raise
    try:
        yield running
    finally:
        lab_mod.down()


@pytest.fixture(params=["gluster", "ceph"])
def netfs(request: pytest.FixtureRequest, lab: lab_mod.Lab) -> Iterator[tuple[Path, Path]]:
    """A fresh directory on one network filesystem, as seen through its two mounts."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    a, b = lab.mount(request.param, "a") / name, lab.mount(request.param, "b") / name
    a.mkdir()
    yield a, b
    shutil.rmtree(a, ignore_errors=True)
