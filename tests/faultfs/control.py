"""The control socket: change fault rules while the filesystem stays mounted.

One JSON object per line each way. Requests::

    {"cmd": "set", "rules": [...], "seed": 7}   -> {"ok": true}
    {"cmd": "stats"}                            -> {"ok": true, "rules": [...], "calls": {...}}

A "set" reply is sent only after the new rules are in force, so a test that
sets rules and then does I/O never races the filesystem.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .rules import Injector

__all__ = ["FaultFS", "serve_control"]


def serve_control(sock_path: str, injector: Injector) -> socketserver.UnixStreamServer:
    """Start the control server in a daemon thread; returns the server."""

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            for line in self.rfile:
                try:
                    req = json.loads(line)
                    if req["cmd"] == "set":
                        injector.set(req.get("rules", []), req.get("seed"))
                        reply: dict[str, Any] = {"ok": True}
                    elif req["cmd"] == "stats":
                        reply = {"ok": True, **injector.stats()}
                    else:
                        reply = {"ok": False, "error": f"unknown cmd {req['cmd']!r}"}
                except Exception as e:  # reported to the client; the fs keeps running
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                self.wfile.write(json.dumps(reply).encode() + b"\n")
                self.wfile.flush()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock_path)
    server = socketserver.ThreadingUnixStreamServer(sock_path, Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="faultfs-control", daemon=True).start()
    return server


@dataclass
class FaultFS:
    """A mounted fault-injecting filesystem, as tests see it.

    ``mnt`` is the mount point to do I/O through; ``root`` is the real
    directory underneath, to inspect what really reached the disk.
    """

    root: Path
    mnt: Path
    sock: Path
    pid: int = 0
    """The daemon's process id (kill it to leave a mount with a dead daemon)."""

    def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(self.sock))
            s.sendall(json.dumps(req).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError(f"faultfs control {self.sock} closed the connection")
                buf += chunk
        reply: dict[str, Any] = json.loads(buf)
        if not reply.get("ok"):
            raise ValueError(f"faultfs rejected {req}: {reply.get('error')}")
        return reply

    def set(self, *rules: dict[str, Any], seed: int | None = None) -> None:
        """Replace all rules (and reset their counters)."""
        self._call({"cmd": "set", "rules": list(rules), "seed": seed})

    def clear(self) -> None:
        self.set()

    def stats(self) -> dict[str, Any]:
        return self._call({"cmd": "stats"})

    def fired(self, index: int = 0) -> int:
        """How many times rule ``index`` of the current set injected its fault."""
        return int(self.stats()["rules"][index]["fired"])

    @contextlib.contextmanager
    def faults(self, *rules: dict[str, Any], seed: int | None = None) -> Iterator[FaultFS]:
        """Rules in force for a ``with`` block, cleared afterwards even on failure."""
        self.set(*rules, seed=seed)
        try:
            yield self
        finally:
            self.clear()
