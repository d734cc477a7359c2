"""ShardedGradScaler: torch's GradScaler for gradients that are sharded across ranks.

    scaler = ShardedGradScaler("cpu")           # or "cuda"; process_group: every rank by default
    scaler.scale(loss).backward()               # loss * scale (in the loss's own dtype)
    scaler.step(opt)                            # unscale_ -> skip if any rank saw inf/NaN
    scaler.update()                             # back off after a skip, grow after N good steps

Invariant: every rank of `process_group` makes the same decision each step. A rank only
sees its own piece of each gradient (an FSDP2 Shard(0) DTensor's local tensor, an FSDP1
flat shard, any plain tensor), so an inf in one rank's piece is invisible to the others;
unscale_ therefore all-reduces the found-inf flag (MAX) through plait.comm before step()
reads it, and the scale, a function of those flags only, stays equal on every rank.

Data flow of unscale_: grads by (device, dtype), DTensors by their local tensor ->
torch._amp_foreach_non_finite_check_and_unscale_ (in place, sets found_inf) -> all-reduce
found_inf over the group -> step() skips optimizer.step() where it is nonzero.

Where it differs from torch's: the flag is reduced with MAX (torch's sum gives the same
decision), and the path for optimizers that unscale themselves (`_step_supports_amp_scaling`,
fused AdamW) syncs the flag too, which torch's leaves per rank.
"""

from __future__ import annotations

from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler, OptState

from plait import comm
from plait.tensor import DTensor


def _refresh_per_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class ShardedGradScaler(GradScaler):
    """torch.distributed.fsdp.ShardedGradScaler, by name, signature and meaning.

    Args (torch's, in torch's order: backoff_factor before growth_factor):
        device: where the scale lives ("cuda", "cpu", ...).
        init_scale, backoff_factor, growth_factor, growth_interval, enabled: as GradScaler.
        process_group: the ranks whose found-inf flags are combined; None (torch's
            `dist.group.WORLD` before init) means every rank.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(device, init_scale=init_scale, backoff_factor=backoff_factor,
                         growth_factor=growth_factor, growth_interval=growth_interval, enabled=enabled)
        if self._enabled:
            self.process_group = process_group
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # -- scale --------------------------------------------------------------------------------

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor | Iterable[torch.Tensor]:
        """`outputs * scale`, each in its own dtype (an fp16/bf16 FSDP loss stays fp16/bf16)."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return self._scale_one(outputs)

        def apply(val):
            if isinstance(val, torch.Tensor):
                return self._scale_one(val)
            if isinstance(val, abc.Iterable):
                it = map(apply, val)
                return type(val)(it) if isinstance(val, (list, tuple)) else it
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def _scale_one(self, t: torch.Tensor) -> torch.Tensor:
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(t.device)
        # the scale is 0-dim, so a DTensor loss (loss_parallel) multiplies by it as a scalar
        return (t * self._scale.to(device=t.device, non_blocking=True)).type(t.dtype)

    # -- unscale ------------------------------------------------------------------------------

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
        """Unscale this rank's pieces in place; found_inf per device (not yet synced)."""
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    # a DTensor grad is unscaled through its local piece: the check and the
                    # in-place multiply are elementwise, so no collective is needed for them
                    local = grad._local_tensor if isinstance(grad, DTensor) else grad
                    if local.is_sparse:
                        if local.dtype is torch.float16:  # coalesce has no fp16 kernel
                            local = local.type(torch.float32).coalesce().type(torch.float16)
                            param.grad = local
                        local = local._values()
                    by_device[local.device][local.dtype].append(local)
            found: dict[torch.device, torch.Tensor] = {}
            for device, per_dtype in by_device.items():
                flag = found.setdefault(device, found_inf.to(device, copy=device != found_inf.device))
                inv = inv_scale.to(device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
        # a rank may hold no piece of any gradient (empty shards): it still joins the sync
        if not found:
            found[found_inf.device] = found_inf
        return found

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide this optimizer's grads by the scale and agree on found-inf across ranks."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # FP32 division can be imprecise for certain compile options: the reciprocal in FP64
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((1,), 0.0, dtype=torch.float32, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        state["stage"] = OptState.UNSCALED
        self._sync_found_inf(state["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # the fused-optimizer path checks without unscaling; its flag must agree too
        found = super()._check_inf_per_device(optimizer)
        self._sync_found_inf(found)
        return found

    def _sync_found_inf(self, found: dict[torch.device, torch.Tensor]) -> None:
        """All-reduce (MAX) every per-device flag over the group, in place."""
        group = self.process_group if self.process_group is not None else comm.world_group()
        handles, on_cpu, moved = [], [], []
        for flag in found.values():
            if self._device != "cpu" and flag.device.type == "cpu":
                # CPU-offloaded grads on a NCCL group: reduce a device copy, copy back
                on_cpu.append(flag)
                flag = flag.to(self._device)
                moved.append(flag)
            handles.append(comm.all_reduce(flag, group=group, op="max", async_op=True))
        for h in handles:
            h.wait()
        if on_cpu:
            torch._foreach_copy_(on_cpu, moved)

    # -- update -------------------------------------------------------------------------------

    def _amp_update_scale_cpu_(self, found_inf: torch.Tensor) -> None:
        """Back off and reset the tracker after an inf; grow every growth_interval good steps."""
        if found_inf.item() >= 1.0:
            self._scale *= self._backoff_factor
            self._growth_tracker.fill_(0)
        else:
            successful = self._growth_tracker + 1
            if successful == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker.fill_(0)
            else:
                self._growth_tracker = successful

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """GradScaler.update, with a CPU path for a scale that lives on the CPU."""
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("update")
        if new_scale is not None or scale.device.type != "cpu":
            super().update(new_scale)
            return
        flags = [f.to(device=scale.device, non_blocking=True)
                 for state in self._per_optimizer_states.values()
                 for f in state["found_inf_per_device"].values()]
        if not flags:
            raise AssertionError("No inf checks were recorded prior to update.")
        combined = flags[0].clone()
        for f in flags[1:]:
            combined += f
        self._amp_update_scale_cpu_(combined)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


__all__ = ["ShardedGradScaler"]
