"""The package's front door: `plait.<name>` for the most-used names, loaded on first use."""

import subprocess
import sys

import pytest

import plait


@pytest.mark.parametrize("name", plait.__all__)
def test_every_exported_name_resolves(name):
    assert getattr(plait, name) is not None


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'fsdp_v9'"):
        plait.fsdp_v9  # noqa: B018


def test_import_plait_does_not_import_torch():
    code = "import sys, plait; assert 'torch' not in sys.modules, 'plait imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
