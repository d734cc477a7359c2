"""torch.distributed.elastic under the porting rule; the launcher itself is `plait run` (plait.run)."""
