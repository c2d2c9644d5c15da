"""The newest-wins background copier shared by the tiers and cross-node shards."""

from __future__ import annotations

import threading

from slurm_ckpt.store.drainer import Drainer


def test_newest_wins_while_a_copy_is_running() -> None:
    started, release = threading.Event(), threading.Event()
    copied: list[int] = []

    def copy(item: int) -> int:
        if item == 1:
            started.set()
            release.wait(30)
        copied.append(item)
        return item * 10

    done: list[tuple[int, int]] = []
    d: Drainer[int] = Drainer(copy, name="t", describe=str, on_done=lambda i, r: done.append((i, r)))
    d.submit(1)
    assert started.wait(30)
    d.submit(2)
    d.submit(3)  # replaces 2, which was still waiting
    assert sorted(d.in_flight()) == [1, 3, 3]  # draining 1; 3 pending and newest
    release.set()
    assert d.drain(30)
    assert copied == [1, 3] and done == [(1, 10), (3, 30)]
    assert d.in_flight() == [] and d.take_error() is None


def test_a_failed_copy_keeps_the_item_and_reports_once() -> None:
    def copy(item: int) -> None:
        raise OSError(5, "Input/output error")

    d: Drainer[int] = Drainer(copy, name="t", describe=lambda i: f"item {i}")
    d.submit(7)
    assert d.drain(30) is False  # idle, but the newest item is not copied
    assert d.in_flight() == [7]  # still protected from retention
    err = d.take_error()
    assert isinstance(err, OSError) and err.errno == 5
    assert d.take_error() is None


def test_disabled_copies_nothing_but_protects_the_newest() -> None:
    copied: list[int] = []
    d: Drainer[int] = Drainer(copied.append, name="t", describe=str, enabled=False)
    d.submit(4)
    assert d.drain(1) is False and copied == [] and d.in_flight() == [4]


def test_a_waiter_on_cv_hears_when_a_copy_starts() -> None:
    """The copy's start is a change of state like its end: ``cv`` is notified."""
    release = threading.Event()

    def copy(item: int) -> None:
        release.wait(30)

    d: Drainer[int] = Drainer(copy, name="t", describe=str)
    with d.cv:
        d.submit(1)  # the thread cannot take the item before wait() releases cv
        notified = d.cv.wait(10)  # False: only the timeout woke us
        draining = d.draining
    release.set()
    assert d.drain(30)
    assert notified and draining == 1
