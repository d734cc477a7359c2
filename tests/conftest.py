import pytest

from plait import testing


@pytest.fixture(scope="session", autouse=True)
def _stop_rank_pools():
    """Every pool of rank processes stops when the session ends."""
    yield
    testing.shutdown()
