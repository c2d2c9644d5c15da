"""The wrapper's end of the control channel: a Unix datagram socket.

The trainer (``slurm_ckpt.control``) sends one datagram per line, ``ready
<pid>`` or ``committed <step> <path>`` (``slurm_ckpt/protocol.py``). Datagrams keep message boundaries,
need no connection (a trainer can report after the wrapper restarted it), and
the socket's fd sits in the wrapper's ``select`` next to its signal fd, so no
polling is needed.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
from pathlib import Path

from ..protocol import Message, parse_message

__all__ = ["ControlServer"]

# sun_path is 108 bytes on Linux; a long $TMPDIR must not break the wrapper.
_MAX_SOCKET_PATH = 100


class ControlServer:
    """A private socket in a fresh 0700 temp dir; :meth:`close` removes both."""

    def __init__(self) -> None:
        base = tempfile.gettempdir()
        if len(base) > _MAX_SOCKET_PATH - 40:
            base = "/tmp"
        self._dir = Path(tempfile.mkdtemp(prefix="slurm-ckpt-", dir=base))
        self.path = str(self._dir / "control.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(self.path)
            self._sock.setblocking(False)
        except OSError:
            self.close()
            raise

    def fileno(self) -> int:
        return self._sock.fileno()

    def receive(self) -> list[Message]:
        """Every message waiting now; never blocks."""
        out: list[Message] = []
        while True:
            try:
                data = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return out
            for line in data.decode(errors="replace").splitlines():
                msg = parse_message(line)
                if msg is not None:
                    out.append(msg)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


