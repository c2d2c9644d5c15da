"""The one C part: the staging copy's non-temporal loop (slurm_ckpt/engine/memcopy.py).

Everything else is in pyproject.toml. The extension is optional: without a C
compiler the install goes on, and staging copies use memmove. It uses no
Python API (ctypes loads it), so one wheel serves every CPython (abi3).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("slurm_ckpt.engine._memcopy", ["slurm_ckpt/engine/_memcopy.c"], optional=True,
                  py_limited_api=True, extra_compile_args=["-O2"]),
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
