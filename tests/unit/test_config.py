"""Config: sizes, validation messages, precedence, and the shipped template."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_ckpt import Config, ConfigError, load_config, parse_size

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "slurm-ckpt.yaml"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40G", 40 * 2**30),
        ("1.5TiB", int(1.5 * 2**40)),
        ("512MiB", 512 * 2**20),
        ("40GB", 40 * 10**9),
        ("0", 0),
        ("  7 k ", 7 * 1024),
        (4096, 4096),
    ],
)
def test_sizes_parse(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["40 potatoes", "-1G", "G", "", "1.2.3G", "1e3G", True, -5])
def test_bad_sizes_are_rejected(text: Any) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


def test_defaults_without_any_file(tmp_path: Path) -> None:
    cfg = load_config(env={"SLURM_CKPT_CONFIG": str(write(tmp_path, ""))})
    assert cfg == Config()
    if not Path("/etc/slurm-ckpt/config.yaml").exists():
        assert load_config(env={}) == Config()


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", env={})


def test_unknown_key_names_file_key_and_valid_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "storage:\n  kepe: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    msg = str(info.value)
    assert str(path) in msg and "'storage.kepe'" in msg
    for valid in ("root", "keep", "on_async_error", "allow_pickle"):
        assert valid in msg


def test_unknown_section_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'storrage'.*valid keys: storage, scratch"):
        load_config(write(tmp_path, "storrage: {}\n"), env={})


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("storage:\n  keep: three\n", "storage.keep"),
        ("storage:\n  keep: true\n", "storage.keep"),
        ("storage:\n  keep: 2.5\n", "storage.keep"),
        ("storage:\n  allow_pickle: maybe\n", "storage.allow_pickle"),
        ("storage:\n  retry_errnos: 5\n", "storage.retry_errnos"),
        ("storage:\n  retry_backoff: soon\n", "storage.retry_backoff"),
        ("storage: [1, 2]\n", "storage"),
        ("scratch:\n  default_size: 40 potatoes\n", "scratch.default_size"),
        ("io:\n  partitions: 5\n", "io.partitions"),
        ("io:\n  partitions:\n    gpu:\n      weight: heavy\n", "io.partitions.gpu.weight"),
        ("- just\n- a list\n", "top level"),
    ],
)
def test_wrong_types_are_rejected_naming_the_key(tmp_path: Path, text: str, where: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(path) in str(info.value) and where in str(info.value)


def test_invalid_yaml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "storage: {keep: [\n")
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path, env={})


def test_values_are_validated_naming_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "storage:\n  keep: 0\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: storage.keep must be at least 1")):
        load_config(path, env={})
    with pytest.raises(ConfigError, match=r"environment: storage\.on_async_error"):
        load_config(
            path, env={"SLURM_CKPT_STORAGE_KEEP": "2", "SLURM_CKPT_STORAGE_ON_ASYNC_ERROR": "x"}
        )


def test_the_removed_lazy_snapshot_is_refused_naming_its_replacement(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  snapshot: lazy\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(path) in str(info.value) and "engine.snapshot" in str(info.value) and "overlap" in str(info.value)
    with pytest.raises(ConfigError, match="overlap"):
        load_config(env={"SLURM_CKPT_CONFIG": os.devnull, "SLURM_CKPT_ENGINE_SNAPSHOT": "lazy"})


def test_precedence_defaults_file_env(tmp_path: Path) -> None:
    path = write(
        tmp_path, "storage:\n  keep: 5\n  root: /file/root\nscratch:\n  default_size: 20G\n"
    )
    cfg = load_config(path, env={})
    assert (cfg.storage.keep, cfg.storage.root, cfg.scratch.default_size) == (
        5,
        "/file/root",
        20 * 2**30,
    )
    assert cfg.storage.retries == Config().storage.retries  # untouched keys keep defaults
    env = {"SLURM_CKPT_STORAGE_KEEP": "7", "SLURM_CKPT_SCRATCH_DEFAULT_SIZE": "1.5TiB",
           "SLURM_CKPT_STORAGE_RETRY_ERRNOS": "EIO, ESTALE", "SLURM_CKPT_ENGINE_DIRECT_IO": "no"}  # fmt: skip
    cfg = load_config(path, env=env)
    assert cfg.storage.keep == 7 and cfg.storage.root == "/file/root"
    assert cfg.scratch.default_size == int(1.5 * 2**40)
    assert cfg.storage.retry_errnos == ("EIO", "ESTALE")
    assert cfg.engine.direct_io is False
    # CLI flags come last, applied by the caller on the frozen result.
    assert dataclasses.replace(cfg.storage, keep=9).keep == 9


def test_config_file_named_by_env(tmp_path: Path) -> None:
    path = write(tmp_path, "storage:\n  keep: 4\n")
    assert load_config(env={"SLURM_CKPT_CONFIG": str(path)}).storage.keep == 4


def test_bad_env_value_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SLURM_CKPT_STORAGE_KEEP"):
        load_config(write(tmp_path, ""), env={"SLURM_CKPT_STORAGE_KEEP": "lots"})


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.storage.keep = 9  # type: ignore[misc]


def _keys(obj: Any, prefix: str = "") -> set[str]:
    out = set()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out.add(prefix + f.name)
        if dataclasses.is_dataclass(value):
            out |= _keys(value, f"{prefix}{f.name}.")
    return out


def _yaml_keys(doc: Any, prefix: str = "", skip: frozenset[str] = frozenset()) -> set[str]:
    out = set()
    for k, v in doc.items():
        out.add(prefix + k)
        if isinstance(v, dict) and prefix + k not in skip:
            out |= _yaml_keys(v, f"{prefix}{k}.", skip)
    return out


def test_template_loads_and_documents_every_key_at_its_default() -> None:
    """templates/slurm-ckpt.yaml cannot rot: it loads, lists every key, and states the defaults."""
    cfg = load_config(TEMPLATE, env={})
    doc = yaml.safe_load(TEMPLATE.read_text())
    listed = _yaml_keys(doc, skip=frozenset({"io.partitions"}))
    missing = _keys(Config()) - listed
    assert not missing, f"{TEMPLATE.name} does not document: {sorted(missing)}"
    assert cfg == Config(), "a default in templates/slurm-ckpt.yaml differs from the code"
    text = TEMPLATE.read_text()
    for key in sorted(_keys(Config())):
        leaf = key.rsplit(".", 1)[-1]
        line = next(i for i, s in enumerate(text.splitlines()) if s.strip().startswith(f"{leaf}:"))
        assert text.splitlines()[line - 1].strip().startswith("#"), f"{key} has no comment above it"


def test_scratch_replicas_is_an_integer_from_zero_off_by_default(tmp_path: Path) -> None:
    assert Config().scratch.replicas == 0
    path = write(tmp_path, "scratch:\n  replicas: 2\n")
    assert load_config(path, env={}).scratch.replicas == 2
    assert load_config(path, env={"SLURM_CKPT_SCRATCH_REPLICAS": "1"}).scratch.replicas == 1
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ConfigError, match=r"scratch\.replicas|SCRATCH_REPLICAS must be of type int"):
            load_config(path, env={"SLURM_CKPT_SCRATCH_REPLICAS": bad})
