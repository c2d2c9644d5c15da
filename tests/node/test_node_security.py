"""Hostile users against the root-run hooks, with a real unprivileged user.

Each case checks the three promises: nothing outside the job's own dir is
touched, chowned or deleted; no link is followed; no user data is executed.
And stage-out never copies a file the user could not read.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from slurm_ckpt.node import run_epilog, run_prolog
from slurm_ckpt.store.layout import list_steps
from tests.node.helpers import User, make_cfg, owned_tree, sh, write_ckpt


def fingerprint(path: Path) -> list[tuple[str, int, int, int, int]]:
    """Names, modes, owners and mtimes of a tree, without following links."""
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames, ""]:
            p = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(p)
            out.append((p, st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns))
    return sorted(out)


@pytest.fixture
def site(pub_tmp: Path, scratch_base: Path, user: User, other_user: User) -> dict[str, Path]:
    """Scratch, durable root with both users' dirs, and a victim dir of the other user."""
    base, root = scratch_base, pub_tmp / "shared"
    owned_tree(root / user.name, user)
    victim = root / other_user.name
    owned_tree(victim, other_user)
    (victim / "theirs").write_text("other user's data")
    os.chown(victim / "theirs", other_user.uid, other_user.gid)
    secret = pub_tmp / "root-secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    return {"base": base, "root": root, "victim": victim, "secret": secret}


def run_job(site: dict[str, Path], user: User, job_id: str, **env: str) -> Path:
    cfg = make_cfg(site["base"], site["root"])
    run_prolog(user.env(job_id, **env), cfg)
    return site["base"] / f"job_{job_id}"


def epilog(site: dict[str, Path], user: User, job_id: str):  # type: ignore[no-untyped-def]
    return run_epilog(user.env(job_id), make_cfg(site["base"], site["root"]))


def test_links_inside_scratch_are_not_followed(site: dict[str, Path], user: User) -> None:
    before = {p: fingerprint(p) for p in (Path("/etc/ssh"), site["victim"])}
    job = run_job(site, user, "11")
    user.run("ln", "-s", "/etc", str(job / "etc"))
    user.run("ln", "-s", str(site["victim"]), str(job / "victim"))
    user.run("ln", "-s", str(site["victim"]), str(job / "ckpt"))  # the whole fast tier a link
    res = epilog(site, user, "11")
    assert res is not None and res.status == "none"  # the victim dir has no checkpoint to steal
    assert not job.exists()
    assert {p: fingerprint(p) for p in before} == before


def test_a_checkpoint_whose_file_the_user_cannot_read_is_not_copied(site: dict[str, Path], user: User) -> None:
    job = run_job(site, user, "12")
    step = write_ckpt(job / "ckpt", 1, owner=user)
    # A hardlink to a root-only file with exactly the bytes the manifest wants:
    # as a checkpoint it is perfect, but the user may not read it.
    # (The root-only file lies on the job's own scratch filesystem: a hardlink cannot cross.)
    data, secret = step / "state.json", job / "root-secret"
    secret.write_bytes(data.read_bytes())
    secret.chmod(0o600)
    data.unlink()
    os.link(secret, data)
    res = epilog(site, user, "12")
    assert res is not None and res.status == "failed" and "Permission denied" in res.detail
    assert list_steps(site["root"] / user.name / "job_12") == []
    assert not list((site["root"] / user.name).rglob("state.json"))
    assert os.lstat(secret).st_uid == 0 and stat.S_IMODE(os.lstat(secret).st_mode) == 0o600
    assert job.exists()  # kept: its checkpoint could not be staged


def test_fifos_devices_and_newlines_do_not_hang_or_escape(site: dict[str, Path], user: User) -> None:
    job = run_job(site, user, "13")
    step = write_ckpt(job / "ckpt", 2, owner=user)
    newer = write_ckpt(job / "ckpt", 3, owner=user)
    # The newest checkpoint's data file is a FIFO: reading it would block forever.
    (newer / "state.json").unlink()
    user.run("mkfifo", str(newer / "state.json"))
    os.mknod(job / "zero", 0o666 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    user.run("mkfifo", str(job / "fifo"))
    user.run("mkdir", str(job / "ckpt" / "step-000000009\n"), str(job / "a\nb"))
    res = epilog(site, user, "13")
    assert res is not None and res.status == "staged" and res.step == 2, res
    assert (site["root"] / user.name / "job_13" / step.name).is_dir()
    assert not job.exists()


def test_hostile_tier_json(site: dict[str, Path], user: User) -> None:
    before = {p: fingerprint(p) for p in (site["victim"], Path("/etc/ssh"))}
    for job_id, tier in [("14", {"durable": str(site["victim"] / "stolen")}),
                         ("15", {"durable": "/etc/slurm-ckpt-pwned"}),
                         ("16", {"durable": "relative/../../etc"}),
                         ("17", "link"), ("18", "fifo"), ("19", "huge")]:  # fmt: skip
        job = run_job(site, user, job_id)
        write_ckpt(job / "ckpt", 1, owner=user)
        tier_path = job / "ckpt" / "TIER.json"
        if tier == "link":
            user.run("ln", "-s", "/etc/shadow", str(tier_path))
        elif tier == "fifo":
            user.run("mkfifo", str(tier_path))
        elif tier == "huge":
            user.run("truncate", "-s", "1G", str(tier_path))
        else:
            tier_path.write_text(json.dumps(tier))
        res = epilog(site, user, job_id)
        assert res is not None
        if job_id == "14":
            # Under storage.root, but in another user's dir: refused before anything is made in it.
            assert res.status == "staged" and str(site["root"] / user.name / "job_14") in str(res.path)
            assert f"{site['victim']} is owned by uid {site['victim'].stat().st_uid}, not by the job's user" in res.detail
            assert not job.exists()
        else:
            # Outside storage.root (refused), or not a usable absolute path: the default durable dir is used.
            assert res.status == "staged" and str(site["root"] / user.name / f"job_{job_id}") in str(res.path)
            assert not job.exists()
            if job_id == "15":
                assert "refused /etc/slurm-ckpt-pwned: not under a stage-out root" in res.detail
    assert not Path("/etc/slurm-ckpt-pwned").exists()
    assert {p: fingerprint(p) for p in before} == before


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_JOB_ID": "../../etc"},
        {"SLURM_JOB_ID": "20;touch /tmp/pwned"},
        {"SLURM_JOB_ID": "$(touch /tmp/pwned)"},
        {"SLURM_JOB_USER": "root"},
        {"SLURM_JOB_USER": "../x"},
        {"SLURM_JOB_UID": "$(id -u)"},
    ],
)
def test_hostile_job_fields_create_nothing(site: dict[str, Path], user: User, env: dict[str, str]) -> None:
    cfg = make_cfg(site["base"], site["root"])
    full = user.env("20") | env
    assert run_prolog(full, cfg) is None
    assert run_epilog(full, cfg) is None
    assert os.listdir(site["base"]) == [] and not Path("/tmp/pwned").exists()


@pytest.mark.parametrize("comment", ["ckpt_scratch=-1G", "ckpt_scratch=" + "9" * 400 + "T",
                                     "ckpt_scratch=99999999999P", "ckpt_scratch=$(reboot)",
                                     "ckpt_size=-3G ckpt_scratch=nan"])  # fmt: skip
def test_hostile_sizes_give_warnings_and_the_default(site: dict[str, Path], user: User, comment: str) -> None:
    cfg = make_cfg(site["base"], site["root"])
    report = run_prolog(user.env("21", SLURM_JOB_COMMENT=comment), cfg)
    assert report is not None and report.size == cfg.scratch.default_size
    assert report.warnings and all("\n" not in w for w in report.warnings)
    assert run_epilog(user.env("21"), cfg) is not None
    assert not (site["base"] / "job_21").exists()


def test_a_header_without_data_offsets_is_a_corrupt_checkpoint_not_a_pin(
    site: dict[str, Path], user: User, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every stage-out failure is caught: a data file whose safetensors header lacks
    ``data_offsets`` once raised a KeyError that kept scratch forever. It is now a
    corrupt checkpoint: skipped, with the reason in the hook log, and the older good
    one staged."""
    import torch

    from slurm_ckpt.errors import CheckpointCorrupt
    from slurm_ckpt.store import RunDir, verify_checkpoint
    from slurm_ckpt.store.codec import encode_state
    from slurm_ckpt.store.writer import write_state

    job = run_job(site, user, "31")
    write_ckpt(job / "ckpt", 1, owner=user)
    enc = encode_state({"w": torch.arange(4, dtype=torch.float32), "step": 2})
    rd = RunDir(job / "ckpt")
    try:
        bad = rd.commit(2, lambda tmp: write_state(tmp, enc), nbytes=enc.nbytes)
    finally:
        rd.unlock()
    (data,) = bad.glob("*.safetensors")
    raw = data.read_bytes()
    assert b'"data_offsets"' in raw
    data.write_bytes(raw.replace(b'"data_offsets"', b'"data_offsetz"'))  # same length, valid JSON
    with pytest.raises(CheckpointCorrupt, match="data_offsets"):  # not a KeyError
        verify_checkpoint(bad, full=False)
    sh("chown", "-R", f"{user.uid}:{user.gid}", str(job / "ckpt"))
    res = epilog(site, user, "31")
    assert res is not None and res.status == "staged" and res.step == 1, res
    assert not job.exists()
    log = capfd.readouterr().err  # the hook log, without --log
    assert re.search(r"passes over \S*step-000000002: .*data_offsets", log), log


def test_a_fifo_at_the_lock_owner_note_does_not_hang_the_stage_out(site: dict[str, Path], user: User) -> None:
    job = run_job(site, user, "32")
    write_ckpt(job / "ckpt", 4, owner=user)
    durable = site["root"] / user.name / "job_32"
    owned_tree(durable, user)
    user.run("mkfifo", str(durable / ".lock.owner"))
    cfg = make_cfg(site["base"], site["root"], epilog_timeout=30)
    res = run_epilog(user.env("32"), cfg)
    assert res is not None and res.status == "staged" and res.step == 4, res
    assert stat.S_ISFIFO(os.lstat(durable / ".lock.owner").st_mode)  # left as it was
    assert not job.exists()


def test_the_job_report_is_roots_and_its_user_may_only_read_it(site: dict[str, Path], user: User) -> None:
    job = run_job(site, user, "22", SLURM_JOB_COMMENT="ckpt_scratch=lots")  # a warning for the report
    report = site["base"] / ".slurm-ckpt" / "job_22.json"
    st = os.lstat(report)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) & 0o007 == 0
    # No write access, no chmod, no hardlink: nothing to fill outside the job's limits.
    for argv in (["chmod", "u+w", str(report)], ["sh", "-c", f"echo x >> {report}"],
                 ["truncate", "-s", "1G", str(report)], ["ln", str(report), str(job / "link")]):  # fmt: skip
        p = user.run(*argv, check=False)
        assert p.returncode != 0, (argv, p)
    assert os.lstat(report).st_size == st.st_size
    # The user reads it: the TaskProlog, running as the user, exports the scratch and prints the warning.
    lines = user.task_prolog("22", site["base"])
    assert f"export SLURM_CKPT_SCRATCH={job}" in lines
    assert "print slurm-ckpt: warning: --comment ckpt_scratch='lots' is not a size like 40G; ignored" in lines
    epilog(site, user, "22")
    assert not report.exists()


def test_without_acls_the_user_reads_a_root_owned_copy_in_scratch(site: dict[str, Path], user: User,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Every filesystem this kernel mounts has POSIX ACLs (its ext4 has no ``noacl``), so the
    seam is the ACL call itself, failing with the errno such a filesystem gives."""
    import errno

    from slurm_ckpt.node import report as report_mod

    def no_acls(*args: object) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(report_mod.os, "setxattr", no_acls)
    job = run_job(site, user, "23")
    report, copy = site["base"] / ".slurm-ckpt" / "job_23.json", job / report_mod.SCRATCH_COPY
    assert user.run("cat", str(report), check=False).returncode != 0  # root's alone: no ACL
    st = os.lstat(copy)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o444)
    for argv in (["chmod", "u+w", str(copy)], ["sh", "-c", f"echo x >> {copy}"]):
        assert user.run(*argv, check=False).returncode != 0
    assert f"export SLURM_CKPT_SCRATCH={job}" in user.task_prolog("23", site["base"])
    epilog(site, user, "23")


@pytest.mark.parametrize("case", ["base is a symlink", "parent owned by the user", "parent group-writable",
                                  "base world-writable and sticky", "user's symlink in a sticky dir"])  # fmt: skip
def test_a_scratch_base_that_is_not_roots_alone_is_a_node_fault(pub_tmp: Path, user: User, case: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from slurm_ckpt.errors import StorageError

    real = pub_tmp / "real"
    real.mkdir()
    link = Path("/tmp") / f"sckt-{user.name}-base"
    if case == "base is a symlink":
        base = pub_tmp / "base"
        base.symlink_to(real)
    elif case == "parent owned by the user":
        owned_tree(pub_tmp / "p", user)
        base = pub_tmp / "p" / "base"
    elif case == "parent group-writable":
        (pub_tmp / "p").mkdir(mode=0o775)
        (pub_tmp / "p").chmod(0o775)
        base = pub_tmp / "p" / "base"
    elif case == "base world-writable and sticky":
        base = real
        base.chmod(0o1777)
    else:
        user.run("ln", "-s", str(real), str(link))
        base = link / "base"
    try:
        cfg = make_cfg(base)
        for hook in (run_prolog, run_epilog):
            with pytest.raises(StorageError, match="scratch base unusable"):
                hook(user.env("24"), cfg)
        err = capsys.readouterr().err
        assert err.count("ERROR: node fault (Slurm drains this node): scratch base unusable") == 2, err
        assert not [p for p in real.rglob("*") if p.name != "base"]  # nothing made in the target
    finally:
        link.unlink(missing_ok=True)


def test_a_root_owned_symlink_above_the_base_is_followed(pub_tmp: Path, user: User) -> None:
    (pub_tmp / "nvme").mkdir()
    (pub_tmp / "local").symlink_to("nvme")  # e.g. /local -> /nvme, made by the admin
    cfg = make_cfg(pub_tmp / "local" / "slurm-ckpt")
    report = run_prolog(user.env("25"), cfg)
    assert report is not None and (pub_tmp / "nvme" / "slurm-ckpt" / "job_25").is_dir()
    run_epilog(user.env("25"), cfg)
