"""The trainer's flag handler under a storm of real signals.

Slurm sends USR1 and TERM back to back to every process of a step. A handler
that takes a lock (``threading.Event.set`` does) deadlocks the trainer when
the second signal lands while the first handler holds it; this test hung
that way 2 times in 3 before the flag became a plain bool.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TRAINER = textwrap.dedent(
    """
    import os, subprocess, sys
    from slurm_ckpt.control import Control

    c = Control(channel="")
    c.install()
    sender = subprocess.Popen([sys.executable, "-c", f'''
    import os, signal, time
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        os.kill({os.getpid()}, signal.SIGUSR1)
        os.kill({os.getpid()}, signal.SIGTERM)
    '''])
    seen = 0
    while sender.poll() is None:  # the training loop: poll the flag, handle, go on
        if c.requested:
            c.clear()
            seen += 1
    print("requests handled:", seen)
    """
)


def test_back_to_back_usr1_and_term_never_deadlock_the_trainer() -> None:
    proc = subprocess.Popen([sys.executable, "-c", TRAINER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()  # TERM is the very signal it handles
        proc.communicate()
        raise AssertionError("the trainer deadlocked in its signal handler") from None
    assert proc.returncode == 0
    assert out.startswith("requests handled: ")
