"""FullyShardedDataParallel: torch's FSDP1 wrapper, a second front door to the engine
behind fully_shard (one implementation of sharding, two doors).

    FSDP(model, auto_wrap_policy=P, sharding_strategy=S, ...)
      -> every module P selects (children first): FSDP(module, same options)
      -> this unit: materialise meta params, sync_module_states, then
         shard_modules([self]) -- the engine's group and hooks, on the wrapper itself
      =  fully_shard(unit) for each unit P selects, then fully_shard(root)

Invariant (use_orig_params=True): a unit's parameters are the engine's Shard(0) DTensors
registered under their original names (inside `_fsdp_wrapped_module`); named_parameters(),
state dicts and optimizer state dicts show the names without `_fsdp_wrapped_module.` (and
without activation checkpointing's `_checkpoint_wrapped_module.`).
Invariant (use_orig_params=False, torch's default): each unit's one parameter is a 1-D flat
`_flat_param` (this rank's shard; its local DTensors are views of it; flat_param.py), under
torch's names (`_fsdp_wrapped_module._flat_param`, the prefixes kept, as torch's: they are
dropped inside summon_full_params only); state dicts and optim_state_dict are keyed by the
original FQNs, as torch's.

Where plait differs from torch, and why:
- use_orig_params=True: named_parameters() names are the clean FQNs (torch keeps the
  `_fsdp_wrapped_module.` prefixes outside summon_full_params).
- use_orig_params=False: the flat shard is every parameter's own padded chunk, concatenated
  (torch: a chunk of the concatenation), so its numel per rank may differ from torch's and
  optim.state_dict()'s raw flat tensors are laid out differently; everything keyed by FQN is
  the same. Between steps the original attributes are None (torch's are views of freed memory).
  A unit's parameters must share a dtype and requires_grad (torch's rule) and be plain tensors.
- LOCAL_STATE_DICT: each parameter's local shard (a plain tensor) under its FQN, not a
  ShardedTensor of `_flat_param` (plait has no ShardedTensor; the flat layout differs, above).
- NO_SHARD: parameters are (Replicate(), Shard(0)) DTensors on an (N, 1) mesh; during a
  step the gathered copy lives beside the shard (torch's NO_SHARD holds one copy).
- HYBRID_SHARD without device_mesh or a group pair raises: torch infers the node size
  from the CUDA device count, which a CPU/Gloo job does not have.
- limit_all_gathers is accepted and has no effect (the engine frees each unit's gathered
  parameters as it goes and prefetches at most one unit ahead).

keep_low_precision_grads=True, as torch's: after backward each sharded parameter's .grad is
in param_dtype (its reduced float32 sum cast down once; a kept .grad is added to in float32
and cast down once), while the parameter keeps its own dtype; an optimizer must accept
that (SGD does; torch's AdamW raises on the dtype mismatch, with either library).
clip_grad_norm_ computes norms in float32 and returns the norm in the grads' dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.device_mesh import DeviceMesh
from plait.fsdp.api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from plait.fsdp.fsdp1 import flat_param, optim_state
from plait.fsdp.fsdp1 import init as fsdp1_init
from plait.fsdp.fsdp1 import state_dict as sd_hooks
from plait.fsdp.fsdp1.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    check_mixed_precision,
)
from plait.fsdp.fsdp1.rekey import rekey_optim_state_dict
from plait.fsdp.fully_shard import _managed_modules, shard_modules
from plait.fsdp.state import FSDPState
from plait.fsdp.wrap import apply_wrap, wrap_targets
from plait.tensor import DTensor

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
_AC_PREFIX = "_checkpoint_wrapped_module."


def clean_tensor_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes."""
    return name.replace(FSDP_PREFIX, "").replace(_AC_PREFIX, "")


class FullyShardedDataParallel(nn.Module):
    """torch.distributed.fsdp.FullyShardedDataParallel's constructor, defaults and methods."""

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable | Any | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
        *,
        _mesh: DeviceMesh | None = None,  # children of an auto-wrapped root reuse its mesh
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
        name = type(module).__name__
        where = f"FullyShardedDataParallel({name})"
        if isinstance(module, FullyShardedDataParallel) or getattr(module, "_plait_fsdp_state", None) is not None:
            inner = type(module.module).__name__ if isinstance(module, FullyShardedDataParallel) else name
            raise ValueError(f"{where}: {inner} is already sharded (FullyShardedDataParallel or fully_shard); "
                             "wrap each module once: wrap the unwrapped module, or its parent")
        strategy = ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy
        if not isinstance(strategy, ShardingStrategy):
            raise TypeError(f"{where}: sharding_strategy must be a ShardingStrategy, got {sharding_strategy!r}")
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise TypeError(f"{where}: backward_prefetch must be a BackwardPrefetch or None, got "
                            f"{backward_prefetch!r}")
        if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
            raise TypeError(f"{where}: cpu_offload must be a CPUOffload, got {type(cpu_offload).__name__}")
        check_mixed_precision(mixed_precision, where)
        ignored_mods, ignored_params = _ignored(module, ignored_modules, ignored_states, where)
        dtype = fsdp1_init.device_type(device_id)
        mesh = _mesh if _mesh is not None else fsdp1_init.build_mesh(process_group, device_mesh, strategy, dtype,
                                                                     where)
        options = dict(sharding_strategy=strategy, cpu_offload=cpu_offload, backward_prefetch=backward_prefetch,
                       mixed_precision=mixed_precision, param_init_fn=param_init_fn, device_id=device_id,
                       sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                       limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params)
        if auto_wrap_policy is not None:
            _auto_wrap(module, auto_wrap_policy, options, ignored_mods, ignored_params, mesh, where)

        self._fsdp_wrapped_module = module
        self.sharding_strategy = strategy
        self.mixed_precision = mixed_precision
        self.cpu_offload = cpu_offload or CPUOffload()
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers  # the engine frees as it goes; nothing to rate-limit
        self.use_orig_params = use_orig_params
        self._device_mesh = mesh
        self._ignored_modules = ignored_mods
        managed = [m for m in _managed_modules([self]) if m is not self and m not in ignored_mods]
        device = torch.device(dtype, device_id) if isinstance(device_id, int) else \
            torch.device(device_id) if device_id is not None else torch.device(dtype)
        fsdp1_init.materialize(managed, param_init_fn, device, where)
        if device_id is not None:
            for m in managed:  # torch moves the unit to device_id before sharding
                m._apply(lambda t: t.to(device), recurse=False)
        if sync_module_states:
            fsdp1_init.sync_module_states(managed, mesh, set(map(id, ignored_params)), where)
        self._buffer_dtypes = _cast_buffers(managed, mixed_precision, ignored_mods)

        mp = mixed_precision or MixedPrecision()
        state = shard_modules(
            [self], mesh=mesh,
            reshard_after_forward=None if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
            else False,
            mp_policy=MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                           cast_forward_inputs=mp.cast_forward_inputs),
            offload_policy=CPUOffloadPolicy(pin_memory=True) if self.cpu_offload.offload_params else OffloadPolicy(),
            ignored_params=ignored_params, mix_in=False)
        state.name = name
        if state.group is not None:
            state.group.name = name
            if mp.keep_low_precision_grads:  # the sharded .grad stays in the compute dtype
                state.group.grad_dtype = mp.param_dtype
        if not forward_prefetch:
            state.forward_prefetch = []
        if backward_prefetch is None:
            state.backward_prefetch = []
        state.prefetch_after_backward = backward_prefetch is BackwardPrefetch.BACKWARD_POST
        self._summoning = 0  # summon_full_params depth: names lose the wrapper prefix within (torch's)
        # holds `_flat_param` (use_orig_params=False) wherever it moves (activation checkpointing
        # wraps it later); a plain attribute, not a second registration of the submodule
        self.__dict__["_flat_owner"] = module
        if not use_orig_params and state.group is not None:
            flat_param.flatten(module, state.group, where)
        self.register_forward_pre_hook(self._root_casts, prepend=True, with_kwargs=True)
        sd_hooks.install(self)

    # -- the wrapper ------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fsdp_wrapped_module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """The wrapped module's attributes show through (model.layers works)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fsdp_wrapped_module":  # not set yet (or a copy being built): do not recurse
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        if not self.use_orig_params:  # torch's names: `_fsdp_wrapped_module._flat_param`, ...
            summoning = self._summoning > 0
            for name, p in super().named_parameters(*args, **kwargs):
                yield (name.replace(FSDP_PREFIX, "") if summoning else name), p
            return
        for name, p in super().named_parameters(*args, **kwargs):
            yield clean_tensor_name(name), p

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for name, b in super().named_buffers(*args, **kwargs):
            yield clean_tensor_name(name), b

    @property
    def _state(self) -> FSDPState:
        return self._plait_fsdp_state

    def _root_casts(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before the engine's first pre-forward: the unit that is about to become the root
        casts its inputs per cast_root_forward_inputs, the others per cast_forward_inputs."""
        state = self._state
        if state.is_root is None and self.mixed_precision is not None:
            state.mp_policy = dataclasses.replace(
                state.mp_policy, cast_forward_inputs=self.mixed_precision.cast_root_forward_inputs)

    # -- static helpers (torch's) ------------------------------------------------------------

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every FullyShardedDataParallel in `module`'s tree (only the outermost with root_only)."""
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return units
        inner = {id(m) for u in units for m in u.modules() if m is not u}
        return [u for u in units if id(u) not in inner]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients locally (unsharded, no collective); the first
        backward after reduces their sum."""
        groups = [s.group for s in _units_states(self) if s.group is not None]
        before = [g.requires_gradient_sync for g in groups]
        for g in groups:
            g.requires_gradient_sync = False
        try:
            yield
        finally:
            for g, b in zip(groups, before):
                g.requires_gradient_sync = b

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that their global norm (over all ranks' shards) is at most
        max_norm; returns that norm before clipping."""
        if self._state.is_root is False:
            raise RuntimeError(f"clip_grad_norm_ must be called on the root FullyShardedDataParallel, not on the "
                               f"{type(self.module).__name__} unit inside it")
        norm_type = float(norm_type)
        flat = {id(s.group.flat_param) for s in _units_states(self)  # sharded, though plain tensors
                if s.group is not None and s.group.flat_param is not None}
        pairs = [(p, p.grad) for p in self.parameters() if p.grad is not None]
        grads = [g for _, g in pairs]
        sharded = [g._local_tensor if isinstance(g, DTensor) else g for p, g in pairs
                   if isinstance(g, DTensor) or id(p) in flat]
        plain = [g for p, g in pairs if not isinstance(g, DTensor) and id(p) not in flat]  # ignored: whole
        group = self._device_mesh.get_group(self._device_mesh.ndim - 1)
        device = sharded[0].device if sharded else plain[0].device if plain else torch.device("cpu")
        f32 = torch.float32  # low-precision grads (keep_low_precision_grads) are summed in float32, as torch's

        def norm(g: torch.Tensor) -> torch.Tensor:
            return torch.linalg.vector_norm(g, norm_type, dtype=f32)

        if norm_type == float("inf"):
            local = torch.stack([norm(g) for g in sharded]).max() if sharded else torch.zeros((), device=device)
            comm.all_reduce(local, group=group, op="max")
            total = torch.stack([local, *[norm(g) for g in plain]]).max()
        else:
            local = sum((norm(g) ** norm_type for g in sharded), torch.zeros((), device=device))
            comm.all_reduce(local, group=group)
            total = (local + sum((norm(g) ** norm_type for g in plain),
                                 torch.zeros((), device=device))) ** (1.0 / norm_type)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in [*sharded, *plain]:
            g.mul_(coef.to(g.dtype))
        if not grads:
            return total
        return total.to(functools.reduce(torch.promote_types, [g.dtype for g in grads]))  # torch's return dtype

    # summon_full_params, state_dict_type & co. live in state_dict.py; bound below
    summon_full_params = staticmethod(sd_hooks.summon_full_params)
    state_dict_type = staticmethod(sd_hooks.state_dict_type)
    set_state_dict_type = staticmethod(sd_hooks.set_state_dict_type)
    get_state_dict_type = staticmethod(sd_hooks.get_state_dict_type)
    optim_state_dict = staticmethod(optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_state.optim_state_dict_to_load)
    rekey_optim_state_dict = staticmethod(rekey_optim_state_dict)


def _units_states(module: nn.Module) -> list[FSDPState]:
    from plait.fsdp.fully_shard import _states

    return list(_states(module, True))


def _ignored(module: nn.Module, ignored_modules: Iterable[nn.Module] | None, ignored_states: Any,
             where: str) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """Ignored modules (with their subtrees) and the parameters FSDP leaves alone."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(f"{where}: pass ignored_modules or ignored_states, not both (torch's rule)")
    items = list(ignored_modules or ignored_states or ())
    mods = [m for m in items if isinstance(m, nn.Module)]
    params = {p for p in items if isinstance(p, nn.Parameter)}
    if len(mods) + len(params) != len(items):
        bad = next(i for i in items if not isinstance(i, (nn.Module, nn.Parameter)))
        raise TypeError(f"{where}: ignored_modules/ignored_states take nn.Modules or nn.Parameters, got "
                        f"{type(bad).__name__}")
    if any(isinstance(m, FullyShardedDataParallel) for m in mods):
        raise ValueError(f"{where}: ignored_modules may not hold FullyShardedDataParallel units")
    subtree = {s for m in mods for s in m.modules()}
    params |= {p for m in subtree for p in m.parameters(recurse=False)}
    return subtree, params


def _auto_wrap(module: nn.Module, policy: Any, options: dict, ignored_mods: set[nn.Module],
               ignored_params: set[nn.Parameter], mesh: DeviceMesh, where: str) -> None:
    """Wrap what `policy` selects in `module` (children first), each with `options`."""
    for sub_name, sub in module.named_modules():
        if sub is not module and sub not in ignored_mods and (
                isinstance(sub, FullyShardedDataParallel) or getattr(sub, "_plait_fsdp_state", None) is not None):
            raise ValueError(f"{where}: submodule {sub_name!r} is sharded already; with auto_wrap_policy, pass a "
                             "model none of whose modules is wrapped (or wrap by hand, without a policy)")
    targets = wrap_targets(module, policy, ignored_modules=ignored_mods, ignored_params=ignored_params,
                           root_kwargs=options)
    mp = options["mixed_precision"]
    if mp is not None and mp._module_classes_to_ignore:
        # torch's rule: these (BatchNorm) get their own unit in full precision
        chosen = {id(m) for m, _ in targets}
        targets += [(m, {**options, "mixed_precision": None}) for m in module.modules()
                    if m is not module and m not in ignored_mods and id(m) not in chosen
                    and isinstance(m, tuple(mp._module_classes_to_ignore))]
    if not any(p is not None for m, _ in targets for p in m.parameters()):
        numel = sum(p.numel() for p in module.parameters())
        fn = getattr(policy, "func", policy)
        shown = getattr(fn, "__name__", type(fn).__name__) + (f"({policy.keywords})" if hasattr(policy, "keywords")
                                                              else "")
        raise ValueError(f"{where}: auto_wrap_policy {shown} wraps no submodule "
                         f"with parameters of {type(module).__name__} ({numel} parameters); check its classes "
                         "or min_num_params, or pass auto_wrap_policy=None to shard the model as one unit")

    def wrap_fn(m: nn.Module, **kwargs: Any) -> nn.Module:
        return FullyShardedDataParallel(m, **kwargs, _mesh=mesh)

    apply_wrap(module, targets, wrap_fn)


def _cast_buffers(managed: list[nn.Module], mp: MixedPrecision | None,
                  ignored: set[nn.Module]) -> dict[tuple[int, str], torch.dtype]:
    """Cast the unit's floating buffers to buffer_dtype; returns their original dtypes
    (state dicts give buffers back in those)."""
    if mp is None or mp.buffer_dtype is None:
        return {}
    orig = {}
    for m in managed:
        if m in ignored:
            continue
        for key, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != mp.buffer_dtype:
                orig[(id(m), key)] = b.dtype
                m._buffers[key] = b.to(mp.buffer_dtype)
    return orig


__all__ = ["FSDP_PREFIX", "FullyShardedDataParallel", "clean_tensor_name"]
