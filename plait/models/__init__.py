"""plait.models — reference models written for parallelization.

Each model reads its shapes from its weights (the local shard under tensor parallel),
names its parameters as torchtitan does, and keeps its blocks in a ModuleDict so that
FSDP can shard them one by one and pipelining can split them by FQN. Each comes with its
canonical parallelization plan.
"""
