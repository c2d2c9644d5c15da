"""Metrics: the exposition text, the atomic textfile, failures by errno, optional serving."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_ckpt.config import MetricsConfig
from slurm_ckpt.metrics import EXPORTED, Metrics, remove_job_textfiles


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(f"{name}{labels} not in exposition")


def test_save_and_load_recorded_with_labels() -> None:
    m = Metrics(labels={"job_id": "42", "rank": "0", "user": 'a"b\\c'}, clock=lambda: 1000.0)
    m.save_committed(step=7, seconds=2.0, nbytes=4_000_000)
    m.save_committed(step=9, seconds=0.2, nbytes=1_000_000)
    m.loaded(seconds=0.3, nbytes=5)
    text = m.render()
    assert sample(text, "slurm_ckpt_last_committed_step", job_id="42") == 9
    assert sample(text, "slurm_ckpt_last_committed_timestamp_seconds") == 1000.0
    assert sample(text, "slurm_ckpt_saves_total") == 2
    assert sample(text, "slurm_ckpt_save_bytes_total") == 5_000_000
    assert sample(text, "slurm_ckpt_save_throughput_bytes_per_second") == 5_000_000
    assert sample(text, "slurm_ckpt_load_bytes_total") == 5
    # Histogram buckets are cumulative: 0.2 s is under le=0.25, 2.0 s under le=2.5.
    assert sample(text, "slurm_ckpt_save_duration_seconds_bucket", le="0.1") == 0
    assert sample(text, "slurm_ckpt_save_duration_seconds_bucket", le="0.25") == 1
    assert sample(text, "slurm_ckpt_save_duration_seconds_bucket", le="2.5") == 2
    assert sample(text, "slurm_ckpt_save_duration_seconds_bucket", le="+Inf") == 2
    assert sample(text, "slurm_ckpt_save_duration_seconds_sum") == pytest.approx(2.2)
    assert sample(text, "slurm_ckpt_load_duration_seconds_count") == 1
    # The hostile label value survives escaping.
    assert sample(text, "slurm_ckpt_saves_total", user='a"b\\c') == 2


def test_failures_counted_by_errno_of_real_errors(tmp_path: Path) -> None:
    m = Metrics()
    for target in (tmp_path / "missing" / "f", tmp_path / "missing" / "g"):
        with pytest.raises(FileNotFoundError), m.time_save(step=1, nbytes=10):
            os.open(target, os.O_WRONLY | os.O_CREAT)
    with pytest.raises(NotADirectoryError), m.time_save(step=2, nbytes=10):
        os.listdir(__file__)
    with pytest.raises(ValueError), m.time_save(step=3, nbytes=10):
        raise ValueError("not an OSError")
    text = m.render()
    assert sample(text, "slurm_ckpt_save_failures_total", errno="ENOENT") == 2
    assert sample(text, "slurm_ckpt_save_failures_total", errno="ENOTDIR") == 1
    assert sample(text, "slurm_ckpt_save_failures_total", errno="other") == 1
    assert sample(text, "slurm_ckpt_saves_total") == 0


def test_time_save_success_and_time_load() -> None:
    m = Metrics()
    with m.time_save(step=5, nbytes=100):
        pass
    with m.time_load() as nbytes:
        nbytes.append(300)
    with m.time_load():
        pass  # nothing loaded: not an observation
    text = m.render()
    assert sample(text, "slurm_ckpt_last_committed_step") == 5
    assert sample(text, "slurm_ckpt_load_duration_seconds_count") == 1
    assert sample(text, "slurm_ckpt_load_bytes_total") == 300


def test_exposition_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (scripts/install-system-deps.sh)")
    m = Metrics(labels={"job_id": "1", "rank": "0", "user": "u"}, requeues=2)
    m.save_committed(1, 1.5, 10)
    m.save_failed(OSError(errno.ENOSPC, "full"))
    m.loaded(0.1, 10)
    m.set_stageout_lag(12.5)
    m.set_durable_stalled(True)
    m.set_replicas(2, 4096, 2048)
    text = m.render()
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # Every family this module documents is really written out.
    written = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert written == EXPORTED


def test_textfile_written_atomically_under_concurrent_reads(tmp_path: Path) -> None:
    m = Metrics(tmp_path / "slurm_ckpt_1_0.prom", {"job_id": "1"})
    m.flush()
    stop = threading.Event()
    bad: list[str] = []
    reads = 0

    def reader() -> None:
        nonlocal reads
        while not stop.is_set():
            text = (tmp_path / "slurm_ckpt_1_0.prom").read_text()
            reads += 1
            try:
                if not text.endswith("\n"):
                    raise ValueError("truncated")
                families(text)
            except ValueError as e:
                bad.append(f"{e}: {text[-80:]!r}")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for step in range(300):
            m.save_committed(step, 0.5, 1 << 20)
    finally:
        stop.set()
        t.join()
    assert reads > 0 and not bad, bad[:3]
    assert sorted(os.listdir(tmp_path)) == ["slurm_ckpt_1_0.prom"]  # no temp files left
    assert sample((tmp_path / "slurm_ckpt_1_0.prom").read_text(), "slurm_ckpt_last_committed_step") == 299


def test_unwritable_textfile_dir_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    m = Metrics(blocker / "m.prom")
    m.save_committed(1, 1.0, 1)
    m.save_committed(2, 1.0, 1)
    warnings = [r for r in caplog.records if "cannot write metrics file" in r.getMessage()]
    assert len(warnings) == 1


def test_from_config_names_file_by_job_and_epilog_removes_it(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "123", "SLURM_PROCID": "3", "SLURM_RESTART_COUNT": "2", "SLURM_JOB_USER": "alice"}
    m = Metrics.from_config(MetricsConfig(textfile_dir=str(tmp_path)), job_id="120_3", env=env)
    other = Metrics.from_config(MetricsConfig(textfile_dir=str(tmp_path)),
                                env={"SLURM_JOB_ID": "1234", "SLURM_PROCID": "0"})  # fmt: skip
    assert m.textfile == tmp_path / "slurm_ckpt_123_3.prom"
    text = m.textfile.read_text()
    assert sample(text, "slurm_ckpt_requeues_total", job_id="120_3", rank="3", user="alice") == 2
    assert remove_job_textfiles(tmp_path, "123") == [m.textfile]
    assert other.textfile is not None and other.textfile.exists()  # job 1234 untouched


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_served_over_http_with_prometheus_client() -> None:
    pytest.importorskip("prometheus_client")
    port = _free_port()
    m = Metrics(labels={"job_id": "9"})
    m.serve(port, addr="127.0.0.1")
    try:
        m.save_committed(77, 1.0, 10)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert sample(body, "slurm_ckpt_last_committed_step", job_id="9") == 77
    finally:
        m.close()


def test_checkpointer_records_saves_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from slurm_ckpt import Checkpointer
    from slurm_ckpt.config import Config

    monkeypatch.setenv("SLURM_JOB_ID", "555")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    cfg = Config(metrics=MetricsConfig(textfile_dir=str(tmp_path / "prom")))
    with Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        ckpt.save({"w": torch.ones(1000)}, step=3)
        ckpt.save_async({"w": torch.ones(1000)}, step=4).wait()
        assert ckpt.load_latest() is not None
        text = (tmp_path / "prom" / "slurm_ckpt_555_0.prom").read_text()
    assert sample(text, "slurm_ckpt_saves_total", job_id="555") == 2
    assert sample(text, "slurm_ckpt_last_committed_step") == 4
    assert sample(text, "slurm_ckpt_save_bytes_total") >= 8000
    assert sample(text, "slurm_ckpt_load_duration_seconds_count") == 1
    assert sample(text, "slurm_ckpt_load_bytes_total") >= 4000
    assert sample(text, "slurm_ckpt_requeues_total") == 1


def test_port_per_local_rank_and_busy_port_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("prometheus_client")
    base = _free_port()
    cfg = MetricsConfig(port=base)
    a = Metrics.from_config(cfg, env={"SLURM_JOB_ID": "1", "SLURM_LOCALID": "0"})
    b = Metrics.from_config(cfg, env={"SLURM_JOB_ID": "1", "SLURM_LOCALID": "0", "SLURM_PROCID": "9"})
    try:
        assert any("cannot serve metrics on port" in r.getMessage() for r in caplog.records)
        body = urllib.request.urlopen(f"http://127.0.0.1:{base}/metrics", timeout=10).read().decode()
        assert sample(body, "slurm_ckpt_saves_total", job_id="1", rank="0") == 0
    finally:
        a.close()
        b.close()
