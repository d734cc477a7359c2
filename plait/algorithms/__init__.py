"""torch.distributed.algorithms under the porting rule (`torch.distributed.X` -> `plait.X`).

Thin twins: the code lives where it belongs in plait's layers — Join and the DDP comm hooks
and model averaging in `plait.ddp`, activation checkpointing in `plait.activation_checkpointing`.
Each submodule has torch's path and names, so `from torch.distributed.algorithms.join import
Join` becomes `from plait.algorithms.join import Join` and means the same.
"""
