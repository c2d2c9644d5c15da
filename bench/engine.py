"""The engine benchmark, runnable without installing the console script.

    python bench/engine.py --size 1G --dir /path/on/the/disk --json out.json --plot out.png

Same options as ``slurm-ckpt bench`` (it is that command); see
``slurm_ckpt/bench/`` for what is measured and how.
"""

from __future__ import annotations

import sys

from slurm_ckpt.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
