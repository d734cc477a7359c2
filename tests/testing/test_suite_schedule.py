"""The suite's two-worker schedule (tests/conftest.py): tests that share a run are one unit of work,
every other test its own."""

import re
from pathlib import Path

from tests.conftest import schedule_unit

ROOT = Path(__file__).parents[2]
# a cache at module level: a functools.cache'd function, or an annotated dict filled by the tests
MODULE_CACHE = re.compile(r"^(@functools\.cache|_?\w+: dict\[.*\] = \{\})", re.M)


def test_a_file_with_a_module_fixture_goes_whole_and_other_tests_one_at_a_time():
    fixture_file = "tests/examples/test_torch_examples.py"  # its torch reference run is module-scoped
    for test in ("test_a", "test_b[--dcp-api]"):
        assert schedule_unit(ROOT, f"{fixture_file}::{test}") == fixture_file
    for nodeid in ("tests/tensor/test_placement.py::test_a", "tests/tensor/test_placement.py::test_b[ws2]",
                   "tests/gone.py::test_x"):
        assert schedule_unit(ROOT, nodeid) == nodeid


def test_the_readme_launches_are_one_unit_across_their_three_files():
    files = ("tests/test_readme.py", "tests/comm/test_exit.py", "tests/comm/test_launch_env.py")
    assert len({schedule_unit(ROOT, f"{f}::test_x") for f in files}) == 1


def test_every_file_with_a_module_level_cache_runs_whole_on_one_worker():
    cached = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").rglob("test_*.py"))
              if MODULE_CACHE.search(p.read_text())]
    assert len(cached) >= 5, cached  # the pattern still finds the caches it was written for
    split = [f for f in cached if schedule_unit(ROOT, f"{f}::a") != schedule_unit(ROOT, f"{f}::b")]
    assert not split, f"add these files to tests/conftest.py's WHOLE_FILES: {split}"
