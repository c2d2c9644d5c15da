"""Job fields from the hook environment: validated before any of them names a path."""

from __future__ import annotations

import os
import pwd

import pytest

from slurm_ckpt.node.job import InvalidJob, Job, comment_size

ROOT = pwd.getpwuid(0)


def env(**kw: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "0", "SLURM_JOB_USER": ROOT.pw_name, **kw}


def test_reads_the_fields_slurmd_sends() -> None:
    job = Job.from_env(env(SLURM_JOB_GID="5", SLURM_JOB_PARTITION="gpu", SLURM_JOB_COMMENT="x",
                           SLURM_JOB_RESTART_COUNT="2"))  # fmt: skip
    assert (job.job_id, job.uid, job.gid, job.user, job.partition, job.comment, job.restart_count) == (
        "42", 0, 5, ROOT.pw_name, "gpu", "x", 2)  # fmt: skip
    assert job.dir_name == "job_42"


@pytest.mark.parametrize(
    "field,value",
    [
        ("SLURM_JOB_ID", "../../etc"),
        ("SLURM_JOB_ID", "42;rm -rf /"),
        ("SLURM_JOB_ID", "$(touch /tmp/x)"),
        ("SLURM_JOB_ID", "42\n43"),
        ("SLURM_JOB_ID", ""),
        ("SLURM_JOB_ID", "-1"),
        ("SLURM_JOB_UID", "0;id"),
        ("SLURM_JOB_UID", "-5"),
        ("SLURM_JOB_USER", "../root"),
        ("SLURM_JOB_USER", "x;rm -rf /"),
        ("SLURM_JOB_USER", "$(id)"),
    ],
)
def test_hostile_fields_are_rejected(field: str, value: str) -> None:
    with pytest.raises(InvalidJob):
        Job.from_env(env(**{field: value}))


def test_unknown_uid_is_rejected() -> None:
    free = next(u for u in range(59000, 60000) if not _exists(u))
    with pytest.raises(InvalidJob, match="not a known user"):
        Job.from_env(env(SLURM_JOB_UID=str(free), SLURM_JOB_USER="nobody-here"))


def _exists(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


@pytest.mark.parametrize(
    "comment,size,warns",
    [
        ("ckpt_scratch=40G", 40 * 2**30, False),
        ("run7, ckpt_scratch=512MiB other=1", 512 * 2**20, False),
        ("ckpt_scratch=1G ckpt_scratch=2G", 2 * 2**30, False),  # the last one wins
        ("nothing here", None, False),
        ("xckpt_scratch=5G", None, False),  # not a token of ours
        ("ckpt_scratch=-5G", None, True),
        ("ckpt_scratch=0", None, True),
        ("ckpt_scratch=" + "9" * 400 + "G", None, True),  # float('9'*400) is inf
        ("ckpt_scratch=99999999P", None, True),  # beyond any disk
        ("ckpt_scratch=$(touch${IFS}/tmp/pwned)", None, True),
        ("ckpt_scratch=`id`", None, True),
        ("ckpt_scratch=1G;reboot", 2**30, False),  # ';' ends the token
    ],
)
def test_comment_size(comment: str, size: int | None, warns: bool) -> None:
    job = Job.from_env(env(SLURM_JOB_COMMENT=comment))
    warnings: list[str] = []
    assert comment_size(job, "ckpt_scratch", warnings) == size
    assert bool(warnings) == warns
    assert all("\n" not in w for w in warnings)
    assert not os.path.exists("/tmp/pwned")
