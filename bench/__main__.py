"""``python -m bench --size 1G --dir /path/on/the/disk``: see :mod:`bench`."""

from bench.cli import bench

bench(prog_name="python -m bench")
