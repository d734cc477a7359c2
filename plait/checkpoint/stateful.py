"""Stateful: anything with state_dict()/load_state_dict(), saved and loaded through them.

Like torch's DCP, a top-level value of the state dict given to save/load that is Stateful
(a module, an optimizer, the tutorial's `AppState(model, optimizer)`, a data loader) is
replaced by its `state_dict()` before flattening; after load fills that dict in place,
its `load_state_dict()` receives it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def expand(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Stateful]]:
    """(the state dict with each Stateful member replaced by its state_dict(), those members)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    members = {k: v for k, v in state_dict.items() if isinstance(v, Stateful)}
    expanded = {k: (v.state_dict() if k in members else v) for k, v in state_dict.items()}
    return expanded, members
