"""MANIFEST.json's rendering: one tensor a line, valid JSON whatever the keys hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_ckpt.errors import CheckpointCorrupt
from slurm_ckpt.store.manifest import MANIFEST, Manifest
from slurm_ckpt.store.tensorfile import FileRecord

# Keys that look like the boundary the renderer breaks lines at, or like JSON itself.
AWKWARD = ['a}, "b', '}, "', 'quote " and \\ backslash', "new\nline", "ünïcödé", "", "{}", '"}, "x": {"'] + [
    f"layers.{i}.weight" for i in range(50)
]


def _write(tmp_path: Path, man: Manifest) -> bytes:
    raw = man.to_bytes()
    (tmp_path / MANIFEST).write_bytes(raw)
    return raw


@pytest.mark.parametrize("keys", [AWKWARD, []], ids=["awkward-keys", "no-tensors"])
def test_tensor_index_round_trips_one_tensor_a_line(tmp_path: Path, keys: list[str]) -> None:
    tensors = {k: {"file": "tensors-00000.safetensors", "dtype": "F32", "shape": [i, 3]} for i, k in enumerate(keys)}
    raw = _write(tmp_path, Manifest(step=7, files={"state.json": FileRecord(2, "0000abcd")}, tensors=tensors))

    back = Manifest.read(tmp_path)
    assert back.tensors == tensors
    assert list(back.tensors) == keys  # the order too: the file's order is the save's
    assert back.files == {"state.json": FileRecord(2, "0000abcd")}
    assert json.loads(raw)["step"] == 7
    lines = raw.decode().splitlines()
    start = lines.index(' "tensors": {' if keys else ' "tensors": {},')
    entries = lines[start + 1 : start + 1 + len(keys)]
    assert [json.loads("{" + line.strip().rstrip(",") + "}") for line in entries] == [
        {k: v} for k, v in tensors.items()
    ]


def test_a_changed_tensor_entry_fails_the_manifests_own_checksum(tmp_path: Path) -> None:
    tensors = {f"w{i}": {"file": "t", "dtype": "F32", "shape": [4]} for i in range(3)}
    raw = _write(tmp_path, Manifest(step=1, files={}, tensors=tensors))
    (tmp_path / MANIFEST).write_bytes(raw.replace(b'"shape": [4]}', b'"shape": [5]}', 1))
    with pytest.raises(CheckpointCorrupt, match="expected manifest_crc32"):
        Manifest.read(tmp_path)


def test_the_manifest_and_the_lock_note_name_the_job_as_requeue_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An array task is ``ARRAYJOB_TASK`` everywhere, as the Checkpointer and scontrol spell it."""
    from slurm_ckpt.store.lock import RunDirLock

    monkeypatch.setenv("SLURM_JOB_ID", "130")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "123")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "4")
    assert Manifest(step=1, files={}).job_id == "123_4"
    lock = RunDirLock(tmp_path)
    lock.acquire()
    try:
        assert RunDirLock(tmp_path).holder().endswith(", job 123_4")
    finally:
        lock.release()
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID")
    assert Manifest(step=1, files={}).job_id == "130"


@pytest.mark.parametrize("metadata", [None, {"format": "pt", "note": 'a "quoted" ünïcödé'}])
@pytest.mark.parametrize("keys", [AWKWARD, [], ["same", "same"]], ids=["awkward-keys", "no-tensors", "a-key-twice"])
def test_a_data_file_header_is_the_bytes_json_dumps_wrote(keys: list[str], metadata: dict[str, str] | None) -> None:
    # The header is written as text, entry by entry: it must stay byte for byte
    # what json.dumps made of the header as a dict, which readers of older files expect.
    import torch

    from slurm_ckpt.store.codec import TensorEntry
    from slurm_ckpt.store.tensorfile import build_header

    entries = [TensorEntry(k, torch.zeros(i, 3), "F32", list(torch.Size([i, 3]))) for i, k in enumerate(keys)]
    entries.append(TensorEntry("0-dim", torch.zeros(()), "BF16", []))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        header[e.key] = {"dtype": e.dtype, "shape": e.shape, "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    want = json.dumps(header, separators=(",", ":")).encode()
    for phase in (0, 64):
        got = build_header(entries, metadata, phase=phase)
        n = int.from_bytes(got[:8], "little")
        assert got[8 : 8 + len(want)] == want and got[8 + len(want) : 8 + n].strip(b" ") == b""
        assert (8 + n) % 4096 == phase
