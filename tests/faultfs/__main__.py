"""``python -m tests.faultfs ROOT MOUNTPOINT --control SOCKET [--seed N]``: mount in the foreground."""

from __future__ import annotations

import argparse
import errno
import logging

import mfusepy

from .control import serve_control
from .fs import FaultOps
from .rules import Injector


class _FUSE(mfusepy.FUSE):
    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        # mfusepy drops rename flags, which would turn RENAME_EXCHANGE into a
        # plain rename. Refuse them the way NFS does, so callers take their
        # no-exchange fallback.
        if flags:
            return -errno.EINVAL
        return int(self.rename_fuse_2(old, new))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tests.faultfs")
    ap.add_argument("root")
    ap.add_argument("mountpoint")
    ap.add_argument("--control", required=True, help="unix socket path for rule changes")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--option", action="append", default=[], help="a FUSE mount option (allow_other, nonempty)")
    args = ap.parse_args()
    # mfusepy logs every errno it returns; injected faults would flood the log.
    logging.basicConfig(level=logging.ERROR)
    inj = Injector()
    if args.seed is not None:
        inj.rng.seed(args.seed)
    serve_control(args.control, inj)
    extra: dict[str, object] = dict(o.split("=", 1) if "=" in o else (o, True) for o in args.option)
    _FUSE(FaultOps(args.root, inj), args.mountpoint, foreground=True,
          fsname="faultfs", subtype="faultfs", **extra)  # fmt: skip


if __name__ == "__main__":
    main()
