"""What every node hook starts from: config, the job, a log line format and a deadline."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, load_config
from ..errors import StorageError
from .deadline import Deadline
from .escape import OneLineFormatter
from .job import Job
from .scratch import STATE_DIR, open_base

__all__ = ["WATCHDOG_ENV", "HookContext", "load_context", "setup_logging", "watchdog_margin"]

log = logging.getLogger("slurm_ckpt.node")


def setup_logging(hook: str, job_id: str) -> None:
    """One line per event on stderr, which the shims append to the hook log.

    Slurm discards hook output, so the shim's log file is the only record;
    records quote user data, so each is escaped onto one bounded line.
    """
    logger = logging.getLogger("slurm_ckpt")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(
        f"%(asctime)s slurm-ckpt {hook}[%(process)d] job {job_id}: %(levelname)s: %(message)s"))  # fmt: skip
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


@dataclass(frozen=True)
class HookContext:
    cfg: Config
    job: Job
    deadline: Deadline

    @property
    def base(self) -> Path:
        return Path(self.cfg.scratch.base)

    @property
    def state_dir(self) -> Path:
        return self.base / STATE_DIR

    @property
    def scratch(self) -> Path:
        return self.base / self.job.dir_name

    def open_base(self) -> int:
        """An fd of the scratch base; if it is unusable, a node fault: logged, then raised."""
        try:
            return open_base(str(self.base))
        except StorageError as e:
            log.error("node fault (Slurm drains this node): %s", e)
            raise

    @property
    def default_durable(self) -> Path | None:
        """``<storage.root>/<user>/job_<id>``: where stage-out goes without TIER.json."""
        root = self.cfg.storage.root
        return Path(root) / self.job.user / self.job.dir_name if root else None


def load_context(hook: str, env: Mapping[str, str] | None, cfg: Config | None,
                 timeout_of: str) -> HookContext:  # fmt: skip
    """Config and job, validated; raises ConfigError or InvalidJob."""
    job = Job.from_env(env)
    setup_logging(hook, job.job_id)
    cfg = cfg or load_config(env=env)
    budget = float(getattr(cfg.scratch, timeout_of))
    watchdog = _watchdog(os.environ if env is None else env)
    if watchdog is not None and budget > watchdog - watchdog_margin(watchdog):
        budget = max(1.0, watchdog - watchdog_margin(watchdog))
        log.warning("scratch.%s is %.0fs but the shim's watchdog kills the hook at %.0fs: using %.1fs "
                    "(raise the watchdog in hooks.env or lower scratch.%s)", timeout_of,
                    getattr(cfg.scratch, timeout_of), watchdog, budget, timeout_of)  # fmt: skip
    return HookContext(cfg, job, Deadline(budget))


WATCHDOG_ENV = "SLURM_CKPT_HOOK_WATCHDOG"
"""Seconds after which the shim kills the hook (exit 11, a drained node); the shim sets it."""


def watchdog_margin(watchdog: float) -> float:
    """Seconds a hook's deadline stays clear of the watchdog: the interpreter's start and exit,
    and a step that overruns its share by a little."""
    return 3.0 + 0.02 * watchdog


def _watchdog(env: Mapping[str, str]) -> float | None:
    try:
        value = float(env.get(WATCHDOG_ENV, ""))
    except ValueError:
        return None
    return value if value > 0 else None
