"""One results table per release, made from the bench's JSON: ``python -m bench.results FILE.json``;
``python -m bench.results --by-fs A.json B.json`` puts runs on several filesystems side by side.

``docs/results/<version>.json`` holds the run a release's table in
``docs/performance.md`` is made from; a test checks the two agree.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from .report import _best, _by, _floor, _limit, _median

__all__ = ["by_filesystem", "results_table", "summary"]


def _ratio(num: float, den: float) -> str:
    return "-" if math.isnan(num) or math.isnan(den) or not den else f"{num / den:.2f}"


def summary(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The figures users ask about, each a ratio within the one run (medians)."""
    results = doc["results"]
    writes, reads = _by(results, "write"), _by(results, "read")

    def med(rows: list[dict[str, Any]], name: str) -> float:
        return next((float(r["median"]) for r in rows if r["name"] == name), math.nan)

    peers = [r for r in writes if not r["name"].startswith(("raw", "ours"))]
    best_peer = min(peers, key=_median, default=None)
    sync = med(writes, "ours sync")
    auto = next((r for r in _by(results, "async") if r["name"].endswith(" auto")), None)
    stall = float(auto["median"]) if auto else math.nan
    rows = [
        ("sync save, x the raw disk", _ratio(_limit(writes, _median), sync)),
        (f"sync save, x the best peer ({best_peer['name']})" if best_peer else "sync save, x the best peer",
         _ratio(best_peer["median"], sync) if best_peer else "-"),
        ("cold load, x the raw disk", _ratio(_limit(reads, _median), med(reads, "ours"))),
        ("cold load into existing tensors (`into=`), x the raw disk",
         _ratio(_limit(reads, _median), med(reads, "ours, into existing tensors"))),
        ("background save's stall (default), x one memcpy of the state", _ratio(stall, _floor(results))),
        ("background save's stall (default), x a sync save", _ratio(stall, sync)),
    ]  # fmt: skip
    sw, sr = _by(results, "small-write"), _by(results, "small-read")
    if len(sw) > 1 and len(sr) > 1:
        rows.append(("10,000 small tensors, write / read, x torch.save / torch.load",
                     f"{_ratio(sw[0]['median'], sw[-1]['median'])} / {_ratio(sr[0]['median'], sr[-1]['median'])}"))
    if auto is not None:
        rows.append(("background save's stall, best repetitions, x one memcpy", _ratio(_best(auto), _floor(results, _best))))
    return rows


def results_table(doc: dict[str, Any], version: str) -> str:
    """The markdown a release's section of docs/performance.md holds."""
    info = doc["info"]
    m = info.get("machine", {})
    head = (f"**{version}**: {m.get('cpu', '?')}, {m.get('cores', info.get('cores', '?'))} cores, "
            f"{m.get('memory_gib', '?')} GiB, Linux {m.get('kernel', '?')}, {m.get('fs', '?')}; "
            f"{info['nbytes'] / 2**30:.2f} GiB in {info['tensors']} tensors, {info['reps']} repetitions, medians.  \n"
            f"`{info.get('command', 'python -m bench')}`")  # fmt: skip
    lines = [head, "", "| | ratio |", "|---|---|"]
    lines += [f"| {label} | {value} |" for label, value in summary(doc)]
    return "\n".join(lines)


def by_filesystem(docs: dict[str, dict[str, Any]]) -> str:
    """One table, a column per filesystem: each method's median speed, then our
    save and load against the best peer and the filesystem's raw limit."""
    cols = list(docs)
    rows: list[tuple[str, list[str]]] = []

    def speed(doc: dict[str, Any], kind: str, name: str) -> float:
        r = [r for r in _by(doc["results"], kind) if r["name"] == name]
        return doc["info"]["nbytes"] / float(r[0]["median"]) / 1e9 if r else math.nan

    def limit(doc: dict[str, Any], kind: str) -> float:
        return doc["info"]["nbytes"] / _limit(_by(doc["results"], kind), _median) / 1e9

    def peers(doc: dict[str, Any], kind: str) -> list[dict[str, Any]]:
        return [r for r in _by(doc["results"], kind) if not r["name"].startswith(("raw", "ours"))
                and "into" not in r["name"]]  # fmt: skip

    for kind, ours in (("write", "ours sync"), ("read", "ours")):
        verb = "save" if kind == "write" else "load"
        names = [r["name"] for r in _by(docs[cols[0]]["results"], kind)]
        rows.append((f"**{verb}, GB/s**", ["" for _ in cols]))
        rows.append(("raw (the faster of O_DIRECT and buffered)", [f"{limit(docs[c], kind):.2f}" for c in cols]))
        rows += [(n, [f"{speed(docs[c], kind, n):.2f}" for c in cols]) for n in names if not n.startswith("raw")]
        best = [min(peers(docs[c], kind), key=_median) for c in cols]
        rows.append((f"ours {verb}, x the best peer", [
            f"{_ratio(float(b['median']), docs[c]['info']['nbytes'] / speed(docs[c], kind, ours) / 1e9)} ({b['name']})"
            for b, c in zip(best, cols, strict=True)]))  # fmt: skip
        rows.append((f"ours {verb}, x raw", [_ratio(speed(docs[c], kind, ours), limit(docs[c], kind)) for c in cols]))
    out = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    out += [f"| {label} | " + " | ".join(vals) + " |" for label, vals in rows]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--by-fs"]:
        print(by_filesystem({Path(a).stem: json.loads(Path(a).read_text()) for a in argv[1:]}))
        return 0
    for arg in argv:
        path = Path(arg)
        print(results_table(json.loads(path.read_text()), path.stem) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
