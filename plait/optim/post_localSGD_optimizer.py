"""PostLocalSGDOptimizer: a local optimizer whose step is followed by model averaging.

    opt.step():  optim.step() (this rank's update) -> averager.average_parameters(param_groups)
    state_dict(): optim's state dict + {"step": averager.step}; load_state_dict restores both

With `post_localSGD_hook` on the DDP model (plait.ddp.comm_hooks), this is post-local SGD in
one object: global gradient averaging until the warm-up ends, then local gradient averaging
and a global parameter average every `period` steps. Storing the averager's step in the
checkpoint keeps a resumed run from warming up again. Same names and behaviour as torch's
`torch.distributed.optim.PostLocalSGDOptimizer`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from plait.ddp.model_averaging import ModelAverager


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Wrap `optim` (any torch optimizer) so that each `step()` runs it, then `averager`.

        local_optim = torch.optim.SGD(model.parameters(), lr=0.01)
        opt = PostLocalSGDOptimizer(local_optim, PeriodicModelAverager(period=4, warmup_steps=100))

    `warmup_steps` should equal the hook's `start_localSGD_iter`: before it DDP already
    averages gradients globally, so averaging parameters too would only cost bytes.
    """

    # Optimizer.__init__ is not called on purpose: every piece of optimizer state
    # (param_groups, state, hooks' targets) belongs to the wrapped optimizer.
    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        self.optim = optim
        self.param_groups = self.optim.param_groups
        self.averager = averager

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def __repr__(self) -> str:
        return self.optim.__repr__()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict plus the averager's step under "step"."""
        state = self.optim.state_dict()
        state["step"] = self.averager.step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load the wrapped optimizer's state and the averager's step; a state dict without
        "step" (saved by the bare optimizer) warns and restarts the averager at step 0."""
        self.optim.load_state_dict(state_dict)
        if "step" in state_dict:
            self.averager.step = state_dict["step"]
        else:
            warnings.warn(
                "Loaded state dict does not contain a step counter for an averager. "
                "Setting step counter to 0.",
                stacklevel=2,
            )
            self.averager.step = 0

    def step(self) -> None:  # type: ignore[override]
        """One local update, then the averager (which averages only when it is due)."""
        self.optim.step()
        self.averager.average_parameters(params=self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:  # type: ignore[override]
        self.optim.add_param_group(param_group)


__all__ = ["PostLocalSGDOptimizer"]
