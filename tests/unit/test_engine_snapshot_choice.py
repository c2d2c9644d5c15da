"""Which snapshot a save uses, as a pure decision over the facts the engine gathers."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from slurm_ckpt.engine.snapshot import Facts, choose_mode

GiB = 1 << 30
ROOMY = Facts(nbytes=GiB, available=8 * GiB)
"""A 1 GiB CPU state, no staging buffer yet, 8 GiB free."""


@pytest.mark.parametrize(
    ("requested", "change", "mode"),
    [
        # auto captures before returning: copy when a staging buffer fits, else fork.
        ("auto", {}, "copy"),
        ("auto", {"available": GiB * 5 // 4}, "copy"),  # a quarter to spare is enough
        ("auto", {"available": GiB * 5 // 4 - 1}, "fork"),
        ("auto", {"available": 0}, "fork"),
        ("auto", {"available": 0, "staging": GiB}, "copy"),  # the kept buffer already holds it
        ("auto", {"available": GiB // 4, "staging": GiB // 2}, "fork"),  # only the growth counts
        ("auto", {"available": GiB * 5 // 8, "staging": GiB // 2}, "copy"),
        ("auto", {"available": 0, "cuda": True}, "copy"),  # device memory must be staged
        ("auto", {"available": 0, "can_fork": False}, "copy"),
        ("auto", {"overlap_ok": False}, "copy"),
        # The modes asked for by name.
        ("copy", {"available": 0}, "copy"),
        ("fork", {}, "fork"),
        ("fork", {"cuda": True}, "copy"),
        ("overlap", {}, "overlap"),
        ("overlap", {"available": 0}, "overlap"),  # it uses the staging buffer, as asked
        ("overlap", {"cuda": True}, "copy"),
        ("overlap", {"overlap_ok": False}, "copy"),  # once a change was caught
        ("sync", {}, "sync"),
        ("sync", {"cuda": True, "available": 0}, "sync"),
    ],
)
def test_choose_mode(requested: str, change: dict[str, Any], mode: str) -> None:
    assert choose_mode(requested, dataclasses.replace(ROOMY, **change)) == mode


@pytest.mark.parametrize("requested", ["lazy", "eager", ""])
def test_an_unknown_mode_is_refused_naming_the_known_ones(requested: str) -> None:
    with pytest.raises(ValueError, match=f"{requested!r}.*overlap"):
        choose_mode(requested, ROOMY)
