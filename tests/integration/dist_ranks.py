"""Run a function on N real processes joined by torch.distributed (gloo over loopback).

``launch(world, "tests.integration.test_x:_worker", args)`` starts ``world``
processes (this module is their entry point), each of which joins the group,
calls ``_worker(rank, world, args)`` and writes its JSON result; it returns
the results by rank, or fails naming the rank and its output.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env() -> dict[str, str]:
    """A rank's environment: this one's, less what would tell it another rank or job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")  # several ranks share few cores
    return env


Wrap = Callable[[int], list[str]]
"""``wrap(rank)``: a command that runs a rank's command line after it (``unshare ... sh -c ...``)."""


def start(world: int, target: str, args: dict[str, Any], out_dir: Path, *, wrap: Wrap | None = None,
          **popen: Any) -> list[subprocess.Popen[str]]:  # fmt: skip
    """Start the ranks; each writes ``out_dir/rank-N.json`` when its function returns."""
    port = free_port()
    env = rank_env()
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.STDOUT)
    def cmd(r: int) -> list[str]:
        return [sys.executable, "-m", "tests.integration.dist_ranks", target, str(r), str(world), str(port),
                json.dumps(args), str(out_dir / f"rank-{r}.json")]  # fmt: skip

    return [subprocess.Popen([*(wrap(r) if wrap else []), *cmd(r)], cwd=ROOT, env=env, text=True, **popen)
            for r in range(world)]  # fmt: skip


def launch(world: int, target: str, args: dict[str, Any], out_dir: Path, *, timeout: float = 600,
           wrap: Wrap | None = None) -> list[Any]:  # fmt: skip
    """Run ``target`` on ``world`` ranks and return their results by rank."""
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = start(world, target, args, out_dir, wrap=wrap)
    outputs: list[str] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out or "")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} of {world} failed (exit {p.returncode}):\n{outputs[r][-6000:]}"
    return [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(world)]


def run_rank(target: str, rank: int, world: int, port: int, args: str, out: str) -> None:
    """Be rank ``rank``: join the group, call ``target``, write its result to ``out``."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=UserWarning)  # DCP and FSDP speak up on every call
    if str(Path(__file__).parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).parent))  # as pytest does: test modules import their neighbours
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    module, name = target.split(":")
    try:
        result = getattr(importlib.import_module(module), name)(rank, world, json.loads(args))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    run_rank(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    # The result is on disk: skip the interpreter's teardown, which torch 2.13's gloo
    # group can abort once an optimizer was built (exit 134; docs/tiers.md).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
