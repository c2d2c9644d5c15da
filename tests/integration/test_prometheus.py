"""The alert rules and the dashboard against real Prometheus tools, and a real scrape:
our textfile -> prometheus-node-exporter -> prometheus -> alert rules evaluated."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_ckpt.config import MetricsConfig
from slurm_ckpt.metrics import EXPORTED, Metrics

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "templates" / "prometheus-rules.yml"
DASHBOARD = REPO / "templates" / "grafana-dashboard.json"
SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_RE = re.compile(r"\bslurm_ckpt_[a-z_]+\b")


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/bin:/usr/sbin")
    if path is None:
        pytest.skip(f"{name} not installed (scripts/install-system-deps.sh)")
    return path


def names_in(expr: str) -> set[str]:
    out = set()
    for m in METRIC_RE.findall(expr):
        base = next((m[: -len(s)] for s in SUFFIXES if m.endswith(s) and m[: -len(s)] in EXPORTED), m)
        out.add(base)
    return out


def test_promtool_accepts_the_rules() -> None:
    r = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 6 rules found" in r.stdout


def test_rules_only_use_exported_metrics() -> None:
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    for r in rules:
        used = names_in(r["expr"])
        assert used and used <= EXPORTED, (r["alert"], used - EXPORTED)
        assert r["labels"]["severity"] in ("info", "warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]


ALERT_TESTS = """\
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # job 1 committed at t=0 and never again; job 2 commits every minute.
      - series: 'slurm_ckpt_last_committed_timestamp_seconds{{job_id="1",rank="0",instance="n1"}}'
        values: '0x120'
      - series: 'slurm_ckpt_last_committed_timestamp_seconds{{job_id="2",rank="0",instance="n1"}}'
        values: '0+60x120'
      # job 3 started at t=0 and has never committed.
      - series: 'slurm_ckpt_start_timestamp_seconds{{job_id="3",rank="0",instance="n2"}}'
        values: '0x120'
      - series: 'slurm_ckpt_save_failures_total{{job_id="2",rank="0",instance="n1",errno="ENOSPC"}}'
        values: '0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1'
      - series: 'slurm_ckpt_saves_total{{job_id="2",rank="0",instance="n1"}}'
        values: '0+1x120'
      - series: 'slurm_ckpt_save_failures_total{{job_id="4",rank="0",instance="n3",errno="EIO"}}'
        values: '0+1x120'
      - series: 'slurm_ckpt_saves_total{{job_id="4",rank="0",instance="n3"}}'
        values: '5x120'
      - series: 'slurm_ckpt_stageout_lag_seconds{{job_id="2",rank="0",instance="n1"}}'
        values: '0+60x120'
      # job 5's durable tier hangs from minute 10 to minute 20.
      - series: 'slurm_ckpt_durable_stalled{{job_id="5",rank="0",instance="n4"}}'
        values: '0x9 1x10 0x100'
    alert_rule_test:
      - eval_time: 50m
        alertname: SlurmCkptNoRecentCheckpoint
        exp_alerts: []
      - eval_time: 70m
        alertname: SlurmCkptNoRecentCheckpoint
        exp_alerts:
          - exp_labels: {{severity: warning, job_id: "1", rank: "0", instance: n1}}
            exp_annotations:
              summary: "Job 1 (rank 0) has no checkpoint for over an hour"
              description: "A failure now would lose more than an hour of training. Check the job's log for save errors and run `slurm-ckpt doctor` on its run dir."
          - exp_labels: {{severity: warning, job_id: "3", rank: "0", instance: n2}}
            exp_annotations:
              summary: "Job 3 (rank 0) has no checkpoint for over an hour"
              description: "A failure now would lose more than an hour of training. Check the job's log for save errors and run `slurm-ckpt doctor` on its run dir."
      - eval_time: 10m
        alertname: SlurmCkptSaveFailures
        exp_alerts:
          - exp_labels: {{severity: warning, job_id: "2", rank: "0", instance: n1, errno: ENOSPC}}
            exp_annotations:
              summary: "Checkpoint saves of job 2 fail with ENOSPC"
              description: "1 save(s) failed with ENOSPC in the last 15 minutes on n1. ENOSPC/EDQUOT: free space or quota; EIO/ESTALE: check the file server; EROFS: the filesystem was remounted read-only."
          - exp_labels: {{severity: warning, job_id: "4", rank: "0", instance: n3, errno: EIO}}
            exp_annotations:
              summary: "Checkpoint saves of job 4 fail with EIO"
              description: "10 save(s) failed with EIO in the last 15 minutes on n3. ENOSPC/EDQUOT: free space or quota; EIO/ESTALE: check the file server; EROFS: the filesystem was remounted read-only."
      - eval_time: 40m
        alertname: SlurmCkptSaveFailuresPersistent
        exp_alerts:
          - exp_labels: {{severity: critical, job_id: "4", rank: "0", instance: n3}}
            exp_annotations:
              summary: "Job 4: every checkpoint save fails"
              description: "No save of job 4 on n3 committed in 30 minutes, and saves are failing."
      - eval_time: 30m
        alertname: SlurmCkptStageoutLag
        exp_alerts: []
      - eval_time: 40m
        alertname: SlurmCkptStageoutLag
        exp_alerts:
          - exp_labels: {{severity: warning, job_id: "2", rank: "0", instance: n1}}
            exp_annotations:
              summary: "Job 2: a checkpoint has waited 40m 0s for stage-out"
              description: "A checkpoint exists only on node-local scratch. If the node dies it is lost. Check the durable filesystem's space and health (`slurm-ckpt doctor <durable dir>`)."
      - eval_time: 11m
        alertname: SlurmCkptDurableStalled
        exp_alerts: []
      - eval_time: 15m
        alertname: SlurmCkptDurableStalled
        exp_alerts:
          - exp_labels: {{severity: critical, job_id: "5", rank: "0", instance: n4}}
            exp_annotations:
              summary: "Job 5: the durable checkpoint storage does not answer"
              description: "A save or a copy to the durable tier on n4 has hung past storage.hang_timeout. Checkpoints stay on node-local scratch (or saves fail without it). Check the file server; `slurm-ckpt doctor <durable dir>` names the hung mount."
      - eval_time: 25m
        alertname: SlurmCkptDurableStalled
        exp_alerts: []
"""


def test_alert_logic_with_promtool(tmp_path: Path) -> None:
    t = tmp_path / "alerts_test.yml"
    t.write_text(ALERT_TESTS.format(rules=RULES))
    r = subprocess.run([tool("promtool"), "test", "rules", str(t)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_dashboard_structure_and_queries() -> None:
    d = json.loads(DASHBOARD.read_text())
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 30
    assert d["__inputs"][0]["type"] == "datasource" and d["__inputs"][0]["pluginId"] == "prometheus"
    ids, cells, seen = set(), set(), set()
    for p in d["panels"]:
        assert p["id"] not in ids and p["type"] in ("stat", "timeseries", "table", "gauge") and p["title"]
        ids.add(p["id"])
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0
        cell = (g["x"], g["y"])
        assert cell not in cells, f"panels overlap at {cell}"
        cells.add(cell)
        assert p["datasource"]["type"] == "prometheus"
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs)
        for t in p["targets"]:
            used = names_in(t["expr"])
            assert used and used <= EXPORTED, (p["title"], used - EXPORTED)
            assert '$job_id' in t["expr"]
            seen |= used
    var = {v["name"]: v for v in d["templating"]["list"]}
    assert names_in(var["job_id"]["definition"]) <= EXPORTED
    # Every exported metric is on the dashboard somewhere.
    assert seen == EXPORTED - {"slurm_ckpt_start_timestamp_seconds"}, EXPORTED - seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def daemon(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        yield p
    finally:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def poll(fn: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except OSError as e:
            last = e
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; last: {last}")


def test_real_scrape_and_alert_evaluation(tmp_path: Path) -> None:
    exporter, prometheus = tool("prometheus-node-exporter"), tool("prometheus")
    textdir = tmp_path / "textfile"
    # A job whose last commit was two hours ago: the no-checkpoint alert must go pending.
    stale = Metrics.from_config(MetricsConfig(textfile_dir=str(textdir)), job_id="777",
                                env={"SLURM_JOB_ID": "777", "SLURM_PROCID": "0"})  # fmt: skip
    stale.clock = lambda: time.time() - 7200
    stale.save_committed(step=1200, seconds=4.0, nbytes=10**9)
    stale.save_failed(OSError(28, "No space left on device"))
    ne_port, prom_port = _free_port(), _free_port()
    rules = tmp_path / "rules.yml"
    # `for:` shortened so the alert reaches "firing" within the test; the expressions are ours.
    rules.write_text(re.sub(r"for: \d+m", "for: 2s", RULES.read_text()))
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(textwrap.dedent(f"""\
        global: {{scrape_interval: 1s, evaluation_interval: 1s}}
        rule_files: [{rules}]
        scrape_configs:
          - job_name: node
            static_configs: [{{targets: ["127.0.0.1:{ne_port}"]}}]
        """))
    with daemon([exporter, f"--web.listen-address=127.0.0.1:{ne_port}", "--collector.disable-defaults",
                 "--collector.textfile", f"--collector.textfile.directory={textdir}"],
                tmp_path / "node_exporter.log"), \
         daemon([prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"], tmp_path / "prometheus.log"):  # fmt: skip
        body = poll(lambda: urllib.request.urlopen(f"http://127.0.0.1:{ne_port}/metrics", timeout=5).read(),
                    "node_exporter")  # fmt: skip
        assert b'slurm_ckpt_last_committed_step{job_id="777",rank="0",user=' in body
        assert b"node_textfile_scrape_error 0" in body
        api = f"http://127.0.0.1:{prom_port}/api/v1"

        def step_value() -> Any:
            res = get_json(f"{api}/query?query=slurm_ckpt_last_committed_step")["data"]["result"]
            return res and res[0]

        s = poll(step_value, "the scraped step")
        assert s["metric"]["job_id"] == "777" and float(s["value"][1]) == 1200

        def firing() -> Any:
            alerts = get_json(f"{api}/alerts")["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "SlurmCkptNoRecentCheckpoint"
                    and a["state"] == "firing"]  # fmt: skip

        (alert,) = poll(firing, "SlurmCkptNoRecentCheckpoint to fire")
        assert alert["labels"]["job_id"] == "777"
        groups = get_json(f"{api}/rules")["data"]["groups"]
        health = {r["name"]: r["health"] for g in groups for r in g["rules"]}
        assert len(health) == 6 and set(health.values()) == {"ok"}, health
