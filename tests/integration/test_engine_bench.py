"""``slurm-ckpt bench`` end to end, tiny: every method runs, and the report adds up.

The figures of an 8 MiB run mean nothing; this checks that the real command
measures every method it promises, writes its JSON and plot, and leaves
nothing behind in the directory it measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_ckpt.cli import main

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("matplotlib")


def test_bench_smoke_8m(tmp_path: Path) -> None:
    out, png, d = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "disk"
    res = CliRunner().invoke(main, ["bench", "--size", "8M", "--reps", "1", "--dir", str(d),
                                    "--json", str(out), "--plot", str(png)])  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    names = {(r["kind"], r["name"]) for r in doc["results"]}
    for kind, name in [("write", "raw O_DIRECT"), ("write", "raw buffered+fsync"), ("read", "raw buffered"),
                       ("write", "torch.save+fsync"), ("write", "safetensors+fsync"),
                       ("write", "ours sync"), ("read", "ours"), ("read", "ours mmap"), ("read", "torch.load"),
                       ("read", "ours, into existing tensors"), ("read", "DCP, into existing tensors"),
                       ("async", "ours async auto"), ("async", "ours async overlap"),
                       ("memcpy", "memcpy floor, 1 thread"),
                       ("small-write", "ours sync (10k tensors)"), ("small-read", "ours (10k tensors)")]:  # fmt: skip
        assert (kind, name) in names
    assert any(k == "write" and n.startswith("DCP") for k, n in names)
    assert any(k == "memcpy" and n.startswith("memcpy of each tensor") for k, n in names)
    # The methods run in a shuffled order; the report lists them in a fixed one.
    writes = [r["name"] for r in doc["results"] if r["kind"] == "write"]
    reads = [r["name"] for r in doc["results"] if r["kind"] == "read"]
    assert writes[0] == "raw O_DIRECT" and writes[3] == "torch.save+fsync" and writes[-1] == "ours sync", writes
    assert reads[0] == "raw O_DIRECT" and reads[3] == "torch.load" and reads[-1].startswith("ours, into"), reads
    for r in doc["results"]:
        assert len(r["times"]) == 1 and r["times"][0] > 0, r
    assert 0.85 * (8 << 20) <= doc["info"]["nbytes"] <= 1.15 * (8 << 20)
    assert doc["info"]["auto_chose"] == "copy"
    assert "ours async auto (copy)" in res.output
    assert "x raw" in res.output and "x torch.save" in res.output and "x memcpy" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in d.iterdir()] == []  # nothing left behind


def test_report_gives_median_and_best_repetition_ratios_to_the_raw_limit() -> None:
    from bench import format_table

    def row(name: str, times: list[float], kind: str = "write") -> dict[str, object]:
        return {"name": name, "kind": kind, "nbytes": 10**9, "times": times, "extra": {},
                "median": sorted(times)[len(times) // 2]}  # fmt: skip

    doc = {"info": {"nbytes": 10**9, "tensors": 1, "reps": 3, "dir": "/d", "cores": 2},
           "results": [row("raw O_DIRECT", [0.30, 0.25, 0.50]), row("raw O_DIRECT x4", [0.20, 0.40, 0.40]),
                       row("torch.save+fsync", [1.0, 0.8, 1.2]), row("ours sync", [0.5, 0.25, 0.9])]}  # fmt: skip
    text = format_table(doc)
    ours = next(line.split() for line in text.splitlines() if line.strip().startswith("ours sync"))
    # median 0.5 s; x raw: the faster raw median (0.30) / 0.5; x torch: 1.0 / 0.5;
    # best x raw: the fastest raw repetition (0.20) / ours' fastest (0.25).
    assert ours[2:] == ["0.500", "2.00", "0.60", "2.00", "0.80"], ours
    assert "best x raw" in text


def test_report_sets_each_stall_against_the_faster_memcpy_floor() -> None:
    from bench import format_table

    def row(name: str, kind: str, median: float, best: float | None = None) -> dict[str, object]:
        return {"name": name, "kind": kind, "nbytes": 10**9, "times": [median, best or median], "median": median,
                "extra": {"durable": [0.5], "stall_with_fence": [median], "staging_bytes": [10**9]}}  # fmt: skip

    doc = {"info": {"nbytes": 10**9, "tensors": 1, "reps": 1, "dir": "/d", "cores": 2, "auto_chose": "copy"},
           "results": [row("raw O_DIRECT", "write", 0.3), row("ours sync", "write", 0.4),
                       row("ours async auto", "async", 0.066, 0.050),
                       row("memcpy floor, 1 thread", "memcpy", 0.060, 0.045),
                       row("memcpy floor, 2 threads", "memcpy", 0.055, 0.050),
                       row("memcpy of each tensor, 2 threads", "memcpy", 0.050)]}  # fmt: skip
    lines = format_table(doc).splitlines()
    auto = next(line.split() for line in lines if "ours async auto (copy)" in line)
    assert auto[4:7] == ["0.0660", "1.20", "0.165"], auto  # stall, x the 2-thread floor, x sync
    one = next(line.split() for line in lines if "memcpy floor, 1 thread" in line)
    assert one[4:7] == ["0.0600", "1.09", "0.150"], one
    each = next(line.split() for line in lines if "memcpy of each tensor" in line)  # not a floor
    assert each[6:9] == ["0.0500", "0.91", "0.125"], each
    target = next(line for line in lines if "default stall:" in line)
    assert "1.32x one memcpy of each" in target and "1.20x one memcpy of the state's bytes" in target, target
    # the fastest save (0.050) over the fastest floor repetition of either row (0.045)
    assert "best repetitions 1.11x" in target, target


def test_each_memcpy_line_copies_into_a_buffer_that_only_it_writes() -> None:
    # A staging buffer is written once a repetition, by its own mode; a floor
    # whose destination other lines wrote just before would be timed warm.
    import torch

    from bench.disk import Raw
    from bench.run import _memcpy_floors

    raw = Raw(4 << 20, 1 << 20)
    flat = {"w": torch.arange(1 << 18, dtype=torch.float32) * 3, "b": torch.arange(1000, dtype=torch.int64)}
    floors = _memcpy_floors(raw, flat)
    assert len(floors) >= 2
    buffers = [copy.args[0] for _, copy in floors]  # type: ignore[attr-defined]
    tensors = b"".join(t.numpy().tobytes() for t in flat.values())
    for i, (name, copy) in enumerate(floors):
        copy()
        want = tensors if "each tensor" in name else bytes(raw.buf)
        assert bytes(buffers[i][: len(want)]) == want, name
        # Lines that write the same bytes (the floors on 1 and N threads) are
        # told apart by what the others' buffers hold: nothing yet.
        assert all(not any(bytes(b)) for b in buffers[i + 1 :]), name
