"""The benchmark's table and chart: every figure a ratio to one measured in the same run."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["format_table", "plot"]

_NAME = 41  # the width of the ASYNC table's name column: its longest memcpy line fits


def _by(results: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in results if r["kind"] == kind]


def _med(r: dict[str, Any], key: str) -> float:
    vals = sorted(r["extra"].get(key) or [])
    if not vals:
        return math.nan
    mid = len(vals) // 2
    return float(vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2)


def _floor(results: list[dict[str, Any]], stat: Callable[[dict[str, Any]], float] = lambda r: r["median"]) -> float:
    """The memcpy floor of a snapshot's stall: the faster of the floor rows, by ``stat``."""
    return min((stat(r) for r in _by(results, "memcpy") if r["name"].startswith("memcpy floor")),
               default=math.nan)  # fmt: skip


def _limit(rows: list[dict[str, Any]], stat: Callable[[dict[str, Any]], float]) -> float:
    """The device limit: the faster of the raw rows (single stream or parallel)."""
    return min((stat(r) for r in rows if r["name"].startswith("raw")), default=math.nan)


def _median(r: dict[str, Any]) -> float:
    return float(r["median"])


def _best(r: dict[str, Any]) -> float:
    return min(r["times"], default=math.nan)


def _rate_table(rows: list[dict[str, Any]], peer: str) -> list[str]:
    """Medians, and beside them the best repetition of each against the best of the raw
    rows: on a shared machine a slow repetition is the machine's as often as the method's,
    and the best shows what the method reaches when nothing else gets in its way."""
    limit, best_limit = _limit(rows, _median), _limit(rows, _best)
    base = next((r["median"] for r in rows if r["name"].startswith(peer)), math.nan)
    out = [f"  {'method':<26} {'median s':>9} {'GB/s':>7} {'x raw':>7} {'x ' + peer:>14} {'best x raw':>11}"]
    for r in rows:
        t = r["median"]
        out.append(f"  {r['name']:<26} {t:9.3f} {r['nbytes'] / t / 1e9:7.2f} {limit / t:7.2f} {base / t:14.2f}"
                   f" {best_limit / _best(r):11.2f}")  # fmt: skip
    return out


def format_table(doc: dict[str, Any]) -> str:
    """The report as text: writes, async saves, updates in flight, reads, small tensors."""
    info, results = doc["info"], doc["results"]
    lines = [f"state {info['nbytes'] / 2**30:.2f} GiB in {info['tensors']} tensors, {info['reps']} "
             f"repetitions interleaved, medians (best: fastest repetition); dir {info['dir']}; {info['cores']} cores; "
             f"page cache dropped by {info.get('cache', '-')}; torch huge pages "
             f"{'on' if info.get('torch_huge_pages') else 'off'}", "", "WRITE (durable: fsynced)"]  # fmt: skip
    writes = _by(results, "write")
    lines += _rate_table(writes, "torch.save")
    sync = next((r["median"] for r in writes if r["name"] == "ours sync"), math.nan)
    floor = _floor(results)
    lines += ["", "ASYNC (stall: save_async returns; x memcpy: x the faster memcpy floor; durable: committed; "
              "staging: reused buffer / state)",
              f"  {'mode':<{_NAME}} {'stall s':>9} {'x memcpy':>9} {'x sync':>7} {'+fence s':>9} {'durable s':>10} "
              f"{'GB/s':>7} {'staging':>8}"]  # fmt: skip
    for r in _by(results, "async"):
        dur = _med(r, "durable")
        name = f"{r['name']} ({info['auto_chose']})" if r["name"].endswith(" auto") and "auto_chose" in info else r["name"]
        lines.append(f"  {name:<{_NAME}} {r['median']:9.4f} {r['median'] / floor:9.2f} {r['median'] / sync:7.3f} "
                     f"{_med(r, 'stall_with_fence'):9.4f} {dur:10.3f} {r['nbytes'] / dur / 1e9:7.2f} "
                     f"{_med(r, 'staging_bytes') / r['nbytes']:8.2f}")  # fmt: skip
    for r in _by(results, "memcpy"):  # the floors, and the tensors copied one by one
        lines.append(f"  {r['name']:<{_NAME}} {r['median']:9.4f} {r['median'] / floor:9.2f} {r['median'] / sync:7.3f}")
    auto = next((r for r in _by(results, "async") if r["name"].endswith(" auto")), None)
    each = next((r["median"] for r in _by(results, "memcpy") if r["name"].startswith("memcpy of each")), None)
    if auto is not None and each is not None:
        # Two floors, both reported: no snapshot of separate tensors is one memcpy
        # of one piece, but that piece is the target's floor. The best repetitions
        # too, as the rate tables give them: a copy slowed by the machine's other
        # work is not the copy's.
        best = _floor(results, _best)
        lines.append(f"  default stall: {auto['median'] / floor:.2f}x one memcpy of the state's bytes in one piece "
                     f"(target: 1.2x; best repetitions {_best(auto) / best:.2f}x), {auto['median'] / each:.2f}x "
                     "one memcpy of each of the state's tensors")  # fmt: skip
    upd = _by(results, "update")
    if upd:
        base = upd[0]["median"]
        lines += ["", "IN-PLACE UPDATE OF THE WHOLE STATE right after save_async (copy-on-write cost)",
                  f"  {'case':<40} {'median s':>9} {'extra s':>8} {'extra x sync':>13}"]  # fmt: skip
        for r in upd:
            extra = r["median"] - base
            lines.append(f"  {r['name']:<40} {r['median']:9.3f} {extra:8.3f} {extra / sync:13.3f}")
    lines += ["", "READ (cold cache, checksums verified where the format has them)"]
    lines += _rate_table(_by(results, "read"), "torch.load")
    for kind, label in (("small-write", "10k SMALL TENSORS, WRITE"), ("small-read", "10k SMALL TENSORS, READ")):
        rows = _by(results, kind)
        if rows:
            base = rows[0]["median"]
            lines += ["", label] + [f"  {r['name']:<34} {r['median']:9.3f} s  x{base / r['median']:.2f} of torch"
                                    for r in rows]  # fmt: skip
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """A bar chart of GB/s (writes and cold reads) and the async stall (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, kind, title in ((axes[0], "write", "write, durable (GB/s)"), (axes[1], "read", "read, cold cache (GB/s)")):
        rows = _by(results, kind)
        names = [r["name"] for r in rows]
        rates = [r["nbytes"] / r["median"] / 1e9 for r in rows]
        colors = ["#888888" if n.startswith("raw") else "#d62728" if n.startswith("ours") else "#1f77b4" for n in names]
        ax.barh(names, rates, color=colors)
        ax.invert_yaxis()
        ax.set_title(title)
        for y, v in enumerate(rates):
            ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    rows = _by(results, "async") + _by(results, "memcpy")
    floor = _floor(results)
    names = [r["name"].replace("ours async ", "") for r in rows]
    axes[2].barh(names, [r["median"] / floor for r in rows],
                 color=["#888888" if r["kind"] == "memcpy" else "#d62728" for r in rows])  # fmt: skip
    axes[2].axvline(1.2, color="k", linestyle="--", linewidth=1)
    axes[2].invert_yaxis()
    axes[2].set_title("async stall / memcpy floor (default's target 1.2)")
    info = doc["info"]
    fig.suptitle(f"slurm-ckpt bench: {info['nbytes'] / 2**30:.2f} GiB state, {info['reps']} reps, medians")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
