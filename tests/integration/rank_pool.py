"""Ranks forked from processes that imported torch and the test module once per module.

``dist_ranks.launch`` starts a new interpreter per rank, which spends seconds
importing torch, torch.distributed and the framework under test before the
rank does anything. A :class:`RankPool` keeps one such interpreter per rank
index (a zygote) for the whole test module: each launch forks a fresh child
from each zygote, which joins a new process group, runs the target and exits.
So every launch still gets fresh processes (a worker's monkeypatching or a
crash ends with its child) and only the imports are shared.

One zygote per rank, not one for all: each is its own interpreter with its own
hash seed, so ranks disagree on ``set`` and ``dict`` orders of strings as
separate processes do, and code that relies on them agreeing still fails.

A zygote forks only while it runs one thread (forking a threaded process can
leave a lock held forever in the child); if an import started a thread, it
says so and the pool launches plain processes from then on.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tests.integration import dist_ranks

__all__ = ["RankPool"]


class _Zygote:
    """One ``python -m tests.integration.rank_pool`` and its line protocol on stdin/stdout."""

    def __init__(self, log: Path) -> None:
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.rank_pool"], cwd=dist_ranks.ROOT,
                env=dist_ranks.rank_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
            )  # fmt: skip
        self._buf = b""

    def send(self, req: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req).encode() + b"\n")
        self.proc.stdin.flush()

    def recv(self, deadline: float) -> dict[str, Any] | None:
        """The next reply, or None when ``deadline`` (monotonic) passes first."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(
                    f"a rank zygote exited (code {self.proc.wait()}):\n{self._log_tail()}"
                )
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # end of input: the zygote exits
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RankPool:
    """``launch`` as :func:`dist_ranks.launch`, from zygotes kept until :meth:`close`."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._zygotes: list[_Zygote] = []
        self.fallback = ""
        """Why the pool gave up forking and launches plain processes; empty while it forks."""

    def launch(self, world: int, target: str, args: dict[str, Any], out_dir: Path, *,
               timeout: float = 600) -> list[Any]:  # fmt: skip
        """Run ``target`` on ``world`` ranks and return their results by rank."""
        if self.fallback:
            return dist_ranks.launch(world, target, args, out_dir, timeout=timeout)
        out_dir.mkdir(parents=True, exist_ok=True)
        while len(self._zygotes) < world:
            self._zygotes.append(_Zygote(self.base / f"zygote-{len(self._zygotes)}.log"))
        deadline = time.monotonic() + timeout
        port = dist_ranks.free_port()
        env = dist_ranks.rank_env()
        zygotes = self._zygotes[:world]
        for r, z in enumerate(zygotes):
            z.send({"target": target, "rank": r, "world": world, "port": port, "args": args,
                    "out": str(out_dir / f"rank-{r}.json"), "log": str(out_dir / f"rank-{r}.log"),
                    "env": env})  # fmt: skip
        # Imports take longest the first time, so the deadline covers them.
        started = [z.recv(deadline) for z in zygotes]
        forked = [
            (z, s["pid"])
            for z, s in zip(zygotes, started, strict=True)
            if s is not None and "pid" in s
        ]
        if len(forked) < world:
            self._kill([pid for _, pid in forked])
            for z, _ in forked:
                z.recv(time.monotonic() + 60)  # its child's exit code
            refused = [s["refused"] for s in started if s is not None and "refused" in s]
            self.fallback = (
                refused[0] if refused else f"the zygotes did not fork within {timeout:.0f} s"
            )
            self.close()
            return dist_ranks.launch(world, target, args, out_dir, timeout=timeout)
        pids = [pid for _, pid in forked]
        codes = [z.recv(deadline) for z in zygotes]
        if None in codes:
            self._kill(pids)  # a hang: ranks that disagree wait in a collective forever
            codes = [
                c if c is not None else z.recv(time.monotonic() + 60)
                for c, z in zip(codes, zygotes, strict=True)
            ]
        failed = [(r, None if c is None else c["code"]) for r, c in enumerate(codes) if c is None or c["code"] != 0]
        # Every failed rank's output: the first to fail is often not the lowest rank.
        assert not failed, "\n".join(
            f"rank {r} of {world} failed (exit {code}):\n"
            + (out_dir / f"rank-{r}.log").read_text(errors="replace")[-6000 // len(failed) :]
            for r, code in failed
        )
        return [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(world)]

    @staticmethod
    def _kill(pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for z in self._zygotes:
            z.close()
        self._zygotes = []


# ---------------------------------------------------------------- the zygote's side


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _child(req: dict[str, Any], proto: list[int]) -> None:
    """In the forked child: become rank ``req["rank"]`` and never return."""
    code = 1
    try:
        for fd in proto:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(req["env"])
        rank, world, port, args = req["rank"], req["world"], req["port"], json.dumps(req["args"])
        sys.argv = [
            dist_ranks.__file__,
            req["target"],
            str(rank),
            str(world),
            str(port),
            args,
            req["out"],
        ]
        dist_ranks.run_rank(req["target"], rank, world, port, args, req["out"])
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _serve() -> None:
    import importlib
    import warnings

    import torch.distributed  # noqa: F401 - the import every rank would pay for

    warnings.filterwarnings("ignore", category=UserWarning)  # as dist_ranks: DCP and FSDP speak up
    sys.path.insert(
        0, str(Path(__file__).parent)
    )  # as pytest does: test modules import their neighbours
    # The protocol keeps its own descriptors; stray prints from imports go to the log.
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    reply = os.fdopen(proto_out, "w")
    for line in os.fdopen(proto_in):
        req = json.loads(line)
        # An import that fails is raised again in the child, into the rank's log, as a
        # fresh process would raise it.
        with contextlib.suppress(Exception):
            importlib.import_module(req["target"].split(":")[0])
        if _threads() != 1:
            reply.write(json.dumps({"refused": f"a rank zygote runs {_threads()} threads after importing "
                                    f"{req['target']}, so it cannot fork safely"}) + "\n")  # fmt: skip
            reply.flush()
            continue
        pid = os.fork()
        if pid == 0:
            _child(req, [proto_in, proto_out])
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


if __name__ == "__main__":
    _serve()
    # Nothing to clean up, and the teardown of torch and the frameworks takes seconds.
    os._exit(0)
