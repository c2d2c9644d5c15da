"""Damaged checkpoints are skipped with their reason, and the previous one is used.

Every case damages the newest of two real checkpoints on disk, then checks the
library (find_latest, load_latest), the CLI through click's runner, and once
the installed console script in a real subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from slurm_ckpt import CheckpointCorrupt, Checkpointer
from slurm_ckpt.cli import main
from slurm_ckpt.store import Skipped, find_latest, verify_checkpoint
from slurm_ckpt.store.manifest import Manifest

DATA = "tensors-00000.safetensors"
STATE = "state.json"
MANIFEST = "MANIFEST.json"
HEADER = 4096  # tensorfile pads the header so data starts here


def state(step: int) -> dict[str, Any]:
    return {
        "model": {
            "w": torch.arange(2048, dtype=torch.float32) + step,
            "b": torch.full((3,), step, dtype=torch.bfloat16),
        },
        "step": step,
        "sampler": {"epoch": step // 10, "seen": list(range(step % 7))},
    }


def make_run(path: Path) -> tuple[Path, Path]:
    with Checkpointer(path, keep=5) as ck:
        old = ck.save(state(1), step=1)
        new = ck.save(state(2), step=2)
    return old, new


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 7)


# name: (damage, file named in the reason, reason text, with expected/actual values)
CASES: dict[str, tuple[Callable[[Path], None], str, str, bool]] = {
    "truncate-data": (lambda d: truncate(d / DATA), DATA, "manifest expects", True),
    "truncate-state": (lambda d: truncate(d / STATE), STATE, "manifest expects", True),
    "flip-data-tensor": (lambda d: flip(d / DATA, HEADER + 100), DATA, "checksum mismatch", True),
    "flip-data-header": (lambda d: flip(d / DATA, 20), DATA, "checksum mismatch", True),
    "flip-state": (lambda d: flip(d / STATE, 5), STATE, "checksum mismatch", True),
    "flip-manifest": (lambda d: flip(d / MANIFEST, 40), MANIFEST, "manifest_crc32", True),
    "delete-manifest": (lambda d: (d / MANIFEST).unlink(), MANIFEST, "manifest missing", False),
    "delete-data": (lambda d: (d / DATA).unlink(), DATA, "file missing (manifest expects", True),
    "garbage-manifest": (
        lambda d: (d / MANIFEST).write_bytes(os.urandom(300)),
        MANIFEST,
        "invalid manifest",
        False,
    ),
}


def _assert_reason(reason: str, bad: Path, fname: str, text: str) -> None:
    assert str(bad / fname) in reason, reason
    assert text in reason, reason


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_newest_is_skipped_and_previous_used(
    case: str, tmp_path: Path, figures: Callable[[str, str], Path]
) -> None:
    damage, fname, text, has_values = CASES[case]
    run = tmp_path / "run"
    old, new = make_run(run)
    damage(new)

    skipped: list[Skipped] = []
    cand = find_latest([run], full=True, skipped=skipped)
    assert cand is not None and cand.path == old
    assert [s.path for s in skipped] == [new]
    _assert_reason(skipped[0].reason, new, fname, text)

    skipped = []
    with Checkpointer(run) as ck:
        got = ck.load_latest(skipped=skipped)
        assert ck.loaded_step == 1 and ck.loaded_path == old
    assert torch.equal(got["model"]["w"], state(1)["model"]["w"]) and got["step"] == 1
    assert [s.path for s in skipped] == [new]
    assert fname in skipped[0].reason

    runner = CliRunner()
    res = runner.invoke(main, ["resume", "--dir", str(run)])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(old)
    assert f"skipped {new}" in res.stderr and fname in res.stderr

    res_json = runner.invoke(main, ["resume", "--dir", str(run), "--json"])
    assert res_json.exit_code == 0 and '"step": 1' in res_json.stdout

    ver = runner.invoke(main, ["verify", str(new)])
    assert ver.exit_code == 4, ver.output
    _assert_reason(ver.stderr, new, fname, text)
    if has_values:
        assert "expect" in ver.stderr, ver.stderr
    ls = runner.invoke(main, ["ls", "--dir", str(run), "--full"])
    assert ls.exit_code == 0
    rows = {line.split()[0]: line for line in ls.stdout.splitlines()[1:]}
    assert "CORRUPT" in rows["2"] and fname in rows["2"] and rows["1"].rstrip().endswith("ok")

    figures(
        f"corruption-{case}",
        f"$ slurm-ckpt resume --dir RUN\n{res.stdout}{res.stderr}"
        f"$ slurm-ckpt verify RUN/{new.name}   (exit {ver.exit_code})\n{ver.stderr}".replace(
            str(run), "RUN"
        ),
    )


def test_console_script_resume_and_verify(tmp_path: Path) -> None:
    """The installed entry point, in a real process, on a checksum failure."""
    exe = Path(sys.executable).with_name("slurm-ckpt")
    run = tmp_path / "run"
    old, new = make_run(run)
    flip(new / DATA, HEADER + 8)
    res = subprocess.run([exe, "resume", "--dir", run], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(old)
    assert res.stderr.count(str(new / DATA)) == 1, "each skip is reported once"
    assert "checksum mismatch: expected crc32" in res.stderr
    ver = subprocess.run([exe, "verify", new], capture_output=True, text=True, timeout=60)
    assert ver.returncode == 4
    assert str(new / DATA) in ver.stderr and "expected crc32" in ver.stderr and "got" in ver.stderr


@pytest.mark.parametrize("fname", [MANIFEST, STATE])
def test_every_single_byte_flip_is_detected(tmp_path: Path, fname: str) -> None:
    """Exhaustive: flipping any one byte of the manifest or state.json fails full verification."""
    _, new = make_run(tmp_path / "run")
    path = new / fname
    good = path.read_bytes()
    missed = []
    for i in range(len(good)):
        for mask in (0x01, 0xFF):
            bad = bytearray(good)
            bad[i] ^= mask
            path.write_bytes(bytes(bad))
            try:
                verify_checkpoint(new, full=True)
                missed.append((i, mask))
            except CheckpointCorrupt:
                pass
    path.write_bytes(good)
    verify_checkpoint(new, full=True)
    assert not missed, f"{fname}: undetected flips at {missed[:10]}"


def test_manifest_checks_its_own_checksum(tmp_path: Path) -> None:
    """A flip in a field no file checksum covers (the time) is still caught."""
    _, new = make_run(tmp_path / "run")
    raw = (new / MANIFEST).read_bytes()
    at = raw.index(b'"time": ') + len(b'"time": ')
    digit = raw[at : at + 1]
    raw = raw[:at] + (b"1" if digit != b"1" else b"2") + raw[at + 1 :]
    (new / MANIFEST).write_bytes(raw)
    with pytest.raises(CheckpointCorrupt, match="expected manifest_crc32"):
        Manifest.read(new)
