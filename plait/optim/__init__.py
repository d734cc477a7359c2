"""Distributed optimizers, under torch.distributed.optim's names."""
