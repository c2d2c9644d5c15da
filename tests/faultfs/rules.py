"""Fault rules: which operation, on which paths, how often, and what goes wrong.

A rule is plain JSON so it crosses the control socket unchanged::

    {"op": "write", "path": "*/tensors-*", "errno": "EIO", "prob": 0.5}
    {"op": ["fsync", "fsyncdir"], "errno": "EIO", "count": 1}
    {"op": "write", "short": true}                 # write half the bytes
    {"op": "*", "delay": 0.2}                      # a stall on every call
    {"op": "write", "errno": "ENOSPC", "after": 3} # the 4th matching write fails

``path`` is an fnmatch glob on the path inside the mount (it starts with ``/``;
``*`` also matches ``/``). ``count`` caps how many times the rule fires;
``after`` lets that many matches pass first. Rules are tried in order and the
first one that fires decides; a rule with only ``delay`` sleeps and lets the
call through.
"""

from __future__ import annotations

import errno as errno_mod
import fnmatch
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OPS", "Action", "Injector", "Rule"]

OPS = frozenset({
    "access", "chmod", "chown", "create", "flush", "fsync", "fsyncdir", "getattr", "link",
    "mkdir", "open", "opendir", "read", "readdir", "readlink", "release", "rename", "rmdir",
    "statfs", "symlink", "truncate", "unlink", "utimens", "write",
})  # fmt: skip


@dataclass
class Rule:
    op: tuple[str, ...] = ("*",)
    path: str = "*"
    errno: int = 0
    prob: float = 1.0
    count: int | None = None
    after: int = 0
    delay: float = 0.0
    short: bool = False
    seen: int = 0
    fired: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Rule:
        unknown = set(d) - {"op", "path", "errno", "prob", "count", "after", "delay", "short"}
        if unknown:
            raise ValueError(f"unknown rule keys {sorted(unknown)}")
        ops = d.get("op", "*")
        ops = (ops,) if isinstance(ops, str) else tuple(ops)
        bad = [o for o in ops if o != "*" and o not in OPS]
        if bad:
            raise ValueError(f"unknown operations {bad}; known: {sorted(OPS)}")
        err = d.get("errno", 0)
        if isinstance(err, str):
            err = getattr(errno_mod, err)
        if not (err or d.get("delay") or d.get("short")):
            raise ValueError(f"rule {d} injects nothing: give errno, delay or short")
        return cls(op=ops, path=d.get("path", "*"), errno=int(err), prob=float(d.get("prob", 1.0)),
                   count=d.get("count"), after=int(d.get("after", 0)),
                   delay=float(d.get("delay", 0.0)), short=bool(d.get("short", False)))  # fmt: skip

    def matches(self, op: str, path: str) -> bool:
        return ("*" in self.op or op in self.op) and fnmatch.fnmatchcase(path, self.path)

    def stats(self) -> dict[str, Any]:
        return {"op": list(self.op), "path": self.path, "errno": self.errno,
                "seen": self.seen, "fired": self.fired}  # fmt: skip


@dataclass(frozen=True)
class Action:
    """What the filesystem must do for one call (after any delay was slept)."""

    errno: int = 0
    short: bool = False


@dataclass
class Injector:
    """Thread-safe rule set, replaced atomically by the control socket."""

    rules: list[Rule] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    calls: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, rules: list[dict[str, Any]], seed: int | None = None) -> None:
        parsed = [Rule.from_json(r) for r in rules]
        with self._lock:
            self.rules = parsed
            self.calls = {}
            if seed is not None:
                self.rng.seed(seed)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"rules": [r.stats() for r in self.rules], "calls": dict(self.calls)}

    def check(self, op: str, path: str) -> Action:
        delay = 0.0
        action = Action()
        with self._lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            for rule in self.rules:
                if not rule.matches(op, path):
                    continue
                rule.seen += 1
                if rule.seen <= rule.after or (rule.count is not None and rule.fired >= rule.count):
                    continue
                if rule.prob < 1.0 and self.rng.random() >= rule.prob:
                    continue
                rule.fired += 1
                delay = rule.delay
                action = Action(rule.errno, rule.short)
                break
        if delay:
            # Sleep outside the lock: a stall on one file must not stall the others.
            time.sleep(delay)
        return action
