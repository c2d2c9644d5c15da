"""Fixtures for the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.rank_pool import RankPool


@pytest.fixture(scope="module")
def rank_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    """``rank_pool.launch(world, target, args, out_dir)``, as ``dist_ranks.launch``, with the
    imports of torch and of the test module paid once per module rather than per rank."""
    pool = RankPool(tmp_path_factory.mktemp("rank-pool"))
    try:
        yield pool
    finally:
        pool.close()
