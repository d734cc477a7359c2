"""Activation checkpointing has one home, plait.activation_checkpointing (wrapper.py: the
checkpoint_wrapper API; composable.py: `checkpoint(module)`); every other path a script may
import it by — torch's twins under the porting rule, and the `plait.<name>` front door — gives
the home's own objects, never a copy.
"""

import importlib
from pathlib import Path

import pytest

import plait
import plait.activation_checkpointing as home

TWINS = {  # plait path (torch's, under the porting rule) -> names it must share with the home
    "plait.algorithms._checkpoint.checkpoint_wrapper": "ActivationWrapper CheckpointImpl CheckpointWrapper "
                                                       "OffloadWrapper apply_activation_checkpointing "
                                                       "checkpoint_wrapper offload_wrapper",
    "plait._composable": "checkpoint",
    "plait._composable.checkpoint_activation": "checkpoint",
}


@pytest.mark.parametrize("path", sorted(TWINS))
def test_twins_are_the_homes_objects(path):
    twin = importlib.import_module(path)
    for name in TWINS[path].split():
        assert getattr(twin, name) is getattr(home, name), f"{path}.{name} is not plait.activation_checkpointing's"


def test_the_front_door_and_the_homes_files():
    assert plait.checkpoint_wrapper is home.wrapper.checkpoint_wrapper
    assert plait.apply_activation_checkpointing is home.wrapper.apply_activation_checkpointing
    assert home.checkpoint is home.composable.checkpoint
    assert sorted(home.__all__) == sorted({n for names in TWINS.values() for n in names.split()})


@pytest.mark.parametrize("old", ["activation_checkpoint", "checkpoint_activation"])
def test_the_mirrored_top_level_modules_are_gone(old):
    """The two mirrored names beside plait/checkpoint/ (a different concept) are not back. By
    file, not by import: an editable install of another checkout can still resolve the name."""
    root = Path(plait.__file__).parent
    assert not (root / f"{old}.py").exists() and not (root / old).exists(), f"plait/{old} is back"
