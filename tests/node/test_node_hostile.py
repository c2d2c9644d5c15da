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
from tests.node.helpers import User, fuse_of, owned_tree, sh, write_ckpt, write_config

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
