"""The shell shims as slurmd runs them: root, no PATH, only the job's variables in the environment."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROLOG = REPO / "prolog" / "slurm-ckpt-prolog"
EPILOG = REPO / "epilog" / "slurm-ckpt-epilog"
TASKPROLOG = REPO / "prolog" / "slurm-ckpt-taskprolog"
BIN = Path(sys.executable).with_name("slurm-ckpt")


@pytest.fixture
def hooks(pub_tmp: Path) -> Path:
    """The hooks installed into a dir with scripts/install-hooks.sh, as the README says."""
    if os.geteuid() != 0:
        pytest.skip("the shims read only root-owned settings")
    d = pub_tmp / "hooks"
    (pub_tmp / "config.yaml").write_text(f"scratch:\n  base: {pub_tmp}/scratch\n  default_size: 64M\n"
                                         f"  min_size: 1M\nstorage:\n  root: {pub_tmp}/shared\n")  # fmt: skip
    p = subprocess.run(["bash", str(REPO / "scripts" / "install-hooks.sh"), "--dest", str(d), "--bin", str(BIN),
                        "--config", str(pub_tmp / "config.yaml"), "--log", str(d / "log" / "hooks.log")],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert f"Prolog={d}/slurm-ckpt-prolog" in p.stdout  # the slurm.conf lines to add
    assert sorted(x.name for x in d.iterdir()) == ["hooks.env", "log", "slurm-ckpt-epilog",
                                                   "slurm-ckpt-prolog", "slurm-ckpt-taskprolog"]  # fmt: skip
    return d


def write_env(d: Path, **settings: str) -> None:
    (d / "hooks.env").write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    (d / "hooks.env").chmod(0o644)


def run(shim: Path, job_id: str = "42", **env: str) -> subprocess.CompletedProcess[str]:
    """Exactly the environment slurmd builds: no PATH, the job's fields."""
    base = {"SLURM_JOB_ID": job_id, "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0", "SLURM_JOB_USER": "root"}
    return subprocess.run([str(shim)], env=base | env, capture_output=True, text=True, timeout=60)


def test_prolog_and_epilog_shims_with_no_path(hooks: Path, pub_tmp: Path) -> None:
    p = run(hooks / PROLOG.name)
    assert (p.returncode, p.stdout, p.stderr) == (0, "", "")  # everything goes to the log
    assert (pub_tmp / "scratch" / "job_42").is_dir()
    t = subprocess.run([str(hooks / TASKPROLOG.name)], env={"SLURM_JOB_ID": "42"}, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert t.returncode == 0 and f"export SLURM_CKPT_SCRATCH={pub_tmp}/scratch/job_42" in t.stdout.splitlines()
    e = run(hooks / EPILOG.name)
    assert e.returncode == 0 and not (pub_tmp / "scratch" / "job_42").exists()
    log = (hooks / "log" / "hooks.log").read_text()
    assert "prolog done" in log and "epilog done" in log


def test_exit_codes(hooks: Path, pub_tmp: Path) -> None:
    write_env(hooks, SLURM_CKPT_BIN=str(pub_tmp / "missing"), SLURM_CKPT_HOOK_LOG=str(hooks / "l"))
    assert run(hooks / PROLOG.name).returncode == 10
    assert run(hooks / TASKPROLOG.name).returncode == 0  # never cancels a task
    slow = pub_tmp / "slow"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    write_env(hooks, SLURM_CKPT_BIN=str(slow), SLURM_CKPT_PROLOG_WATCHDOG="1",
              SLURM_CKPT_HOOK_LOG=str(hooks / "l"))  # fmt: skip
    t0 = time.monotonic()
    assert run(hooks / PROLOG.name).returncode == 11
    assert time.monotonic() - t0 < 10
    write_env(hooks, SLURM_CKPT_BIN="/bin/false", SLURM_CKPT_HOOK_LOG=str(hooks / "l"))
    assert run(hooks / EPILOG.name).returncode == 12
    assert "reported a node fault (exit 1)" in (hooks / "l").read_text()


def test_settings_writable_by_others_are_ignored(hooks: Path) -> None:
    (hooks / "hooks.env").chmod(0o666)
    p = run(hooks / PROLOG.name)
    # Not read: the default binary path is used, which is not installed here.
    assert p.returncode == 10 and not (hooks / "log" / "hooks.log").exists()


def test_hostile_job_fields_through_the_shim(hooks: Path, pub_tmp: Path) -> None:
    for job_id in ("$(touch /tmp/pwned-shim)", "1;touch /tmp/pwned-shim", "../../etc", "`id`"):
        p = run(hooks / PROLOG.name, job_id, SLURM_JOB_COMMENT="ckpt_scratch=$(touch /tmp/pwned-shim)")
        assert p.returncode == 0
        assert run(hooks / EPILOG.name, job_id).returncode == 0
    assert not Path("/tmp/pwned-shim").exists()
    assert not (pub_tmp / "scratch").exists() or not [
        p for p in (pub_tmp / "scratch").iterdir() if p.name != ".slurm-ckpt"
    ]


def test_load_only_guard_defines_functions_and_runs_nothing(hooks: Path) -> None:
    script = f'SLURM_CKPT_SHIM_LOAD_ONLY=1; . "{hooks / PROLOG.name}"; die 12 "from a test"'
    p = subprocess.run(["/bin/bash", "-c", script], capture_output=True, text=True, timeout=30,
                       env={"SLURM_JOB_ID": "7"})  # fmt: skip
    assert p.returncode == 12 and "job 7: from a test" in p.stderr
    assert not (hooks / "log" / "hooks.log").exists()


def test_the_hook_bench_reports_ratios_to_the_interpreter() -> None:
    """``bench/hooks.py`` (a benchmark, not a timed test) runs and prints each hook's
    ratio to the bare interpreter, measured in the same loop. Only a hang guard here."""
    if os.geteuid() != 0:
        pytest.skip("the bench runs the prolog, which makes scratch dirs as root")
    p = subprocess.run([sys.executable, str(REPO / "bench" / "hooks.py"), "--reps", "2"], capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr
    rows = {" ".join(line.split()[:-4]): line.split()[-4:] for line in p.stdout.splitlines()[3:8]}
    assert set(rows) == {"yardstick", "prolog none", "epilog none", "prolog loop", "epilog loop"}, p.stdout
    assert rows["yardstick"][2:] == ["1.00", "1.00"]
    assert all(float(x) > 0 for r in rows.values() for x in r), p.stdout
    assert "target (none): each hook's wall median at most 2.0x" in p.stdout
    print(p.stdout)


def test_the_hook_path_imports_neither_torch_nor_the_engine() -> None:
    """The hooks run before and after every job: they load only what they use (the store's
    writer and reader only in the stage-out child, subprocess only to run a command)."""
    heavy = ("torch", "slurm_ckpt.engine", "slurm_ckpt.checkpointer", "slurm_ckpt.store.commit",
             "slurm_ckpt.store.verify", "slurm_ckpt.store.writer", "subprocess", "secrets")  # fmt: skip
    code = ("import sys, slurm_ckpt.cli, slurm_ckpt.node, slurm_ckpt.node.prolog, slurm_ckpt.node.epilog; "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_hook_log_is_roots_alone(hooks: Path, pub_tmp: Path) -> None:
    log = hooks / "log" / "hooks.log"
    assert run(hooks / PROLOG.name).returncode == 0
    st = log.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o600)  # it names users, jobs and paths
    log.chmod(0o644)  # a log an older install left readable
    assert run(hooks / EPILOG.name).returncode == 0
    assert log.stat().st_mode & 0o777 == 0o600 and "epilog done" in log.read_text()
    # A symlink at the log's name is never written through.
    target = pub_tmp / "elsewhere"
    target.write_text("")
    log.unlink()
    log.symlink_to(target)
    assert run(hooks / PROLOG.name, "43").returncode == 0
    assert target.read_text() == "" and target.stat().st_mode & 0o777 == 0o644


def test_the_shims_run_slurm_ckpt_from_the_root_dir(hooks: Path, pub_tmp: Path) -> None:
    """slurmd's working directory is not where a hook should import or read anything from."""
    fake, where = pub_tmp / "fake-bin", pub_tmp / "cwd-seen"
    fake.write_text(f'#!/bin/sh\npwd > "{where}"\n')
    fake.chmod(0o755)
    write_env(hooks, SLURM_CKPT_BIN=str(fake), SLURM_CKPT_HOOK_LOG=str(hooks / "l"))
    planted = pub_tmp / "slurmd-cwd"
    planted.mkdir()
    for shim in (PROLOG, EPILOG):
        where.unlink(missing_ok=True)
        p = subprocess.run([str(hooks / shim.name)], cwd=planted, env={"SLURM_JOB_ID": "7"}, timeout=60)
        assert p.returncode == 0 and where.read_text() == "/\n"


def test_a_scratch_base_not_roots_alone_drains_with_the_reason_logged(hooks: Path, pub_tmp: Path) -> None:
    (pub_tmp / "real").mkdir()
    (pub_tmp / "linked").symlink_to(pub_tmp / "real")
    (pub_tmp / "config.yaml").write_text(f"scratch:\n  base: {pub_tmp}/linked\n")
    assert run(hooks / PROLOG.name).returncode == 12
    assert run(hooks / EPILOG.name).returncode == 12
    log = (hooks / "log" / "hooks.log").read_text()
    assert log.count(f"ERROR: node fault (Slurm drains this node): scratch base unusable: {pub_tmp}/linked: "
                     "a symlink") == 2, log  # fmt: skip
    assert "reported a node fault" in log and not list((pub_tmp / "real").iterdir())
