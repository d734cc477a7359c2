import functools
from pathlib import Path

import pytest

from plait import testing


@pytest.fixture(scope="session", autouse=True)
def _stop_rank_pools():
    """Every pool of rank processes stops when the session ends."""
    yield
    testing.shutdown()


# Tests that share one run through a cache go to one worker as one unit, so the run happens once.
# A file with a module-scoped fixture is one unit without being listed here.
WHOLE_FILES = {  # module-level references, in the test process or in each pool rank
    "tests/train/test_parity.py",
    "tests/fsdp/test_tp_torch_placements.py",
    "tests/pipelining/test_runtime_parity.py",
    "tests/pipelining/test_pp_fsdp.py",
}
README_LAUNCHES = {  # test_readme.plait_run_failures: every README example under plait run; test_exit.plait_pair
    "tests/test_readme.py",
    "tests/comm/test_exit.py",
    "tests/comm/test_launch_env.py",
}


@functools.cache
def _has_module_fixture(path: Path) -> bool:
    return path.is_file() and 'scope="module"' in path.read_text()


def schedule_unit(root: Path, nodeid: str) -> str:
    """What one xdist worker runs as one unit: the README's launches (three files), a file with a
    module-level cache (WHOLE_FILES) or a module-scoped fixture (a reference run of torch's own
    example, a launched job), else the test alone."""
    path = nodeid.split("::", 1)[0]
    if path in README_LAUNCHES:
        return "readme launches"
    return path if path in WHOLE_FILES or _has_module_fixture(root / path) else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The suite runs in two pytest-xdist workers (pyproject's addopts): while one waits on a
    launched job (a rendezvous, a heartbeat, a late rank), the other computes. Units of work
    (`schedule_unit`) are handed out as workers free up."""
    from xdist.scheduler import LoadScopeScheduling

    class OneFixtureOnce(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return schedule_unit(config.rootpath, nodeid)

    return OneFixtureOnce(config, log)
