"""The hook log against a hostile user: no forged lines, no flood, the child's output captured.

The hooks run here as the shims run them (``slurm-ckpt node epilog``, stdout
and stderr appended to a log file), with a real unprivileged user, real
loop-mounted scratch and real crafted checkpoints.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest

from slurm_ckpt.node.escape import RECORD_LIMIT, escape
from slurm_ckpt.node.hook import setup_logging
from slurm_ckpt.node.stageresult import StageResult
from slurm_ckpt.node.userchild import OUTPUT_LIMIT
from slurm_ckpt.store.manifest import FORMAT, VERSION
from tests.node.helpers import (
    User,
    craft_ckpt,
    owned_tree,
    raw_manifest,
    run_hook,
    sh,
    write_ckpt,
    write_config,
)

# Every line of the hook log is one record that starts like this.
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} slurm-ckpt (prolog|epilog)\[\d+\] job \d+: "
                    r"(INFO|WARNING|ERROR): ")  # fmt: skip
FORGED = "2030-01-01 00:00:00,000 slurm-ckpt epilog[1] job 1: INFO: stage-out staged: forged"


def test_escape_keeps_one_bounded_line() -> None:
    assert escape("plain text, a \\ and 'quotes'") == "plain text, a \\ and 'quotes'"
    assert escape("a\nb\r\tc\x1b[31m\u202eexe.txt\udcff") == "a\\nb\\r\\tc\\x1b[31m\\u202eexe.txt\\udcff"
    assert escape("é ü 日本") == "é ü 日本"  # printable text stays readable
    huge = "x" * 20_000_000
    assert escape(huge, 100) == "x" * 100 + "...[19999900 more characters]"
    assert escape(OSError(2, "gone\nforged")) == "[Errno 2] gone\\nforged"


def test_hook_log_records_are_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("epilog", "7")
    log = logging.getLogger("slurm_ckpt.node")
    log.warning("file %s is bad", "a\n" + FORGED)
    try:
        raise ValueError("boom\n" + FORGED)
    except ValueError:
        log.exception("failed")
    log.info("%s", "y" * 50_000)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(RECORD.match(line) for line in lines), lines
    assert "Traceback" in lines[1] and "\\n" in lines[1]  # the traceback stays in its record
    assert max(map(len, lines)) <= RECORD_LIMIT + 40


def test_a_malformed_child_result_is_bounded_and_checked() -> None:
    def res(**doc: object) -> StageResult:
        return StageResult.from_child(json.dumps({"status": "staged", "detail": "", "step": 1, "path": None,
                                                  **doc}).encode())  # fmt: skip

    assert res(detail="a\n" + FORGED * 1000).detail.count("\n") == 0
    assert len(res(detail="z" * 100_000).detail) < 2100
    assert res(status="owned").status == "failed"
    assert res(step="1; rm").step is None
    assert StageResult.from_child(b'{"status": "sta').status == "failed"


@pytest.fixture
def hooks(pub_tmp: Path, scratch_base: Path, user: User) -> dict[str, Path]:
    """Config, log and durable root for hooks run through the CLI, as the shims run them."""
    root = pub_tmp / "shared"
    owned_tree(root / user.name, user)
    return {"base": scratch_base, "root": root, "log": pub_tmp / "hooks.log",
            "config": write_config(pub_tmp / "config.yaml", scratch_base, root)}  # fmt: skip


def records(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines()
    assert lines and all(RECORD.match(line) for line in lines), [x[:200] for x in lines if not RECORD.match(x)]
    return lines


def test_a_file_name_with_a_newline_forges_no_log_line(hooks: dict[str, Path], user: User) -> None:
    env = user.env("31")
    assert run_hook("prolog", env, hooks["config"], hooks["log"]) == 0
    # A checkpoint whose data file the user may not read (root's, 0600) and whose
    # name carries a newline and a whole fake record: its name ends up in the
    # stage-out's failure, which the epilog logs.
    name = "data\n" + FORGED + ".bin"
    step = craft_ckpt(hooks["base"] / "job_31" / "ckpt", 3, {name: b"x" * 100}, owner=user)
    sh("chown", "root:root", str(step / name))
    (step / name).chmod(0o600)
    assert run_hook("epilog", env, hooks["config"], hooks["log"]) == 0
    lines = hooks["log"].read_text().splitlines()
    quoted = [line for line in lines if "forged" in line]
    assert quoted and all("Permission denied" in line for line in quoted), quoted  # quoted, on its record's line
    records(hooks["log"])
    assert (hooks["base"] / "job_31").exists()  # kept: it could not be staged


def test_a_20mb_manifest_field_makes_no_20mb_record(hooks: dict[str, Path], user: User) -> None:
    env = user.env("32")
    assert run_hook("prolog", env, hooks["config"], hooks["log"]) == 0
    write_ckpt(hooks["base"] / "job_32" / "ckpt", 2, owner=user)
    # The durable run dir holds a "newer" checkpoint whose manifest field is 20 MB.
    bad = hooks["root"] / user.name / "job_32" / "step-000000009"
    owned_tree(bad.parent, user)
    owned_tree(bad, user)
    (bad / "MANIFEST.json").write_bytes(raw_manifest({"format": "X" * 20_000_000, "version": VERSION}))
    sh("chown", "-R", f"{user.uid}:{user.gid}", str(bad))
    assert run_hook("epilog", env, hooks["config"], hooks["log"]) == 0
    assert hooks["log"].stat().st_size < 100_000, f"{hooks['log'].stat().st_size} bytes of log"
    lines = records(hooks["log"])
    assert any("stage-out staged" in line for line in lines)
    assert max(map(len, lines)) <= RECORD_LIMIT + 100


def test_the_stage_out_childs_output_is_captured_and_capped(hooks: dict[str, Path], user: User) -> None:
    env = user.env("33")
    assert run_hook("prolog", env, hooks["config"], hooks["log"]) == 0
    # 200 "shards" whose manifests fail with a 50 kB field each: the store logs every
    # one it skips, 10 MB of records in all, from the child that runs as the user.
    rank = hooks["base"] / "job_33" / "ckpt" / "rank-00000"
    for step in range(1, 201):
        d = rank / f"step-{step:09d}"
        d.mkdir(parents=True)
        (d / "MANIFEST.json").write_bytes(raw_manifest({"format": FORMAT, "version": "v" * 50_000}))
    sh("chown", "-R", f"{user.uid}:{user.gid}", str(hooks["base"] / "job_33" / "ckpt"))
    assert run_hook("epilog", env, hooks["config"], hooks["log"]) == 0
    assert hooks["log"].stat().st_size < 4 * OUTPUT_LIMIT, f"{hooks['log'].stat().st_size} bytes of log"
    child = [line for line in records(hooks["log"]) if ": stage-out: " in line]
    assert any("skipping shard" in line for line in child)
    assert sum(len(line) for line in child) < OUTPUT_LIMIT + 2 * 1024
    assert any("bytes of its output dropped" in line for line in child)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
