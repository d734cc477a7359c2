"""torch.distributed.elastic.multiprocessing: only `errors`, what a worker script imports."""
