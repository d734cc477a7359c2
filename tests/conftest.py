import functools
from pathlib import Path

import pytest

from plait import testing


@pytest.fixture(scope="session", autouse=True)
def _stop_rank_pools():
    """Every pool of rank processes stops when the session ends."""
    yield
    testing.shutdown()


# Files whose tests share one run through a cache, by the unit that runs them on one worker (so the
# run happens once). A file with a module-scoped fixture is its own unit without being listed.
SHARED_RUNS = {
    # test_readme.plait_run_failures: every README example under plait run; test_exit.plait_pair
    "tests/test_readme.py": "readme launches",
    "tests/comm/test_exit.py": "readme launches",
    "tests/comm/test_launch_env.py": "readme launches",
    # module-level references, in the test process or in each pool rank
    "tests/train/test_parity.py": "tests/train/test_parity.py",
    "tests/fsdp/test_tp_torch_placements.py": "tests/fsdp/test_tp_torch_placements.py",
    "tests/pipelining/test_runtime_parity.py": "tests/pipelining/test_runtime_parity.py",
    "tests/pipelining/test_pp_fsdp.py": "tests/pipelining/test_pp_fsdp.py",
}


@functools.cache
def _has_module_fixture(path: Path) -> bool:
    return path.is_file() and 'scope="module"' in path.read_text()


def schedule_unit(root: Path, nodeid: str) -> str:
    """What one xdist worker runs as one unit: the files of a shared run (SHARED_RUNS), a file
    whose fixture is module-scoped (a reference run of torch's own example, a launched job), else
    the test alone."""
    path = nodeid.split("::", 1)[0]
    if path in SHARED_RUNS:
        return SHARED_RUNS[path]
    return path if _has_module_fixture(root / path) else nodeid


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
