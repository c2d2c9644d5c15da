"""The CLI's contract: --version, --help everywhere, resume/ls/verify outputs and exit codes."""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

import slurm_ckpt
from slurm_ckpt import Checkpointer
from slurm_ckpt.cli import main


@pytest.fixture
def cli() -> CliRunner:
    return CliRunner()


def make_run(run: Path, steps: list[int]) -> list[Path]:
    with Checkpointer(run, keep=100) as ck:
        return [ck.save({"w": torch.ones(256) * s, "step": s}, step=s) for s in steps]


def all_commands(group: click.Group, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        yield (*prefix, name)
        if isinstance(cmd, click.Group):
            yield from all_commands(cmd, (*prefix, name))


def test_version(cli: CliRunner) -> None:
    res = cli.invoke(main, ["--version"])
    assert res.exit_code == 0
    assert res.stdout.strip() == f"slurm-ckpt, version {slurm_ckpt.__version__}"
    assert slurm_ckpt.__version__ == importlib.metadata.version("slurm-ckpt")


def test_every_command_has_help(cli: CliRunner) -> None:
    commands = list(all_commands(main))
    assert {("resume",), ("ls",), ("verify",)} <= set(commands)
    for argv in [(), *commands]:
        for flag in ("--help", "-h"):
            res = cli.invoke(main, [*argv, flag])
            assert res.exit_code == 0, f"{argv} {flag}: {res.output}"
            assert "Usage: " in res.stdout and "Options:" in res.stdout


def test_resume_with_no_checkpoint_exits_3(cli: CliRunner, run_dir: Path) -> None:
    res = cli.invoke(main, ["resume", "--dir", str(run_dir)])
    assert res.exit_code == 3
    assert res.stdout == "" and f"no valid checkpoint in {run_dir}" in res.stderr
    res = cli.invoke(main, ["resume", "--dir", str(run_dir), "--json"])
    assert res.exit_code == 3
    assert json.loads(res.stdout) == {"path": None, "step": None}


def test_resume_prints_newest_and_json(cli: CliRunner, run_dir: Path) -> None:
    paths = make_run(run_dir, [10, 20])
    res = cli.invoke(main, ["resume", "--dir", str(run_dir)])
    assert res.exit_code == 0 and res.stdout == f"{paths[-1]}\n" and res.stderr == ""
    doc = json.loads(cli.invoke(main, ["resume", "--dir", str(run_dir), "--json"]).stdout)
    assert doc["path"] == str(paths[-1]) and doc["step"] == 20
    assert doc["nbytes"] == 256 * 4 and isinstance(doc["time"], float) and "job_id" in doc


def test_resume_defaults_to_slurm_ckpt_dir(
    cli: CliRunner, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = make_run(run_dir, [3])
    monkeypatch.setenv("SLURM_CKPT_DIR", str(run_dir))
    res = cli.invoke(main, ["resume"])
    assert res.exit_code == 0 and res.stdout.strip() == str(paths[0])


def test_usage_and_config_errors_exit_2(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli.invoke(main, ["resume", "--bogus"]).exit_code == 2
    assert cli.invoke(main, ["verify"]).exit_code == 2
    assert cli.invoke(main, ["verify", str(tmp_path / "absent")]).exit_code == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("storage:\n  kepe: 1\n")
    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(bad))
    res = cli.invoke(main, ["resume"])
    assert res.exit_code == 2 and "kepe" in res.stderr and str(bad) in res.stderr


def test_ls_columns_and_status(cli: CliRunner, run_dir: Path) -> None:
    res = cli.invoke(main, ["ls", "--dir", str(run_dir)])
    assert res.exit_code == 0 and "no checkpoints" in res.stdout
    paths = make_run(run_dir, [5, 15, 25])
    (paths[1] / "MANIFEST.json").unlink()
    for flag, ok in (([], "ok (sizes)"), (["--full"], "ok")):
        lines = cli.invoke(main, ["ls", "--dir", str(run_dir), *flag]).stdout.splitlines()
        assert lines[0].split() == ["STEP", "TIME", "(UTC)", "SIZE", "STATUS"]
        rows = [line.split(None, 4) for line in lines[1:]]
        assert [r[0] for r in rows] == ["25", "15", "5"]
        assert rows[0][4] == ok and rows[2][4] == ok
        assert rows[0][3].endswith("KiB") and rows[0][1].count("-") == 2
        assert "  CORRUPT: " in lines[2] and "MANIFEST.json: manifest missing" in lines[2]


def test_verify_ok_and_bad(cli: CliRunner, run_dir: Path) -> None:
    (good,) = make_run(run_dir, [1])
    res = cli.invoke(main, ["verify", str(good)])
    assert res.exit_code == 0 and res.stdout.startswith("ok: step 1, 2 files")
    data = good / "tensors-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 1
    data.write_bytes(bytes(raw))
    res = cli.invoke(main, ["verify", str(good)])
    assert res.exit_code == 4
    assert f"{data}: checksum mismatch: expected crc32" in res.stderr and ", got " in res.stderr
    os.truncate(data, 100)
    res = cli.invoke(main, ["verify", str(good)])
    assert res.exit_code == 4 and f"{data}: size is 100, manifest expects" in res.stderr
