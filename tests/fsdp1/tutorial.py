"""PyTorch's FSDP1 tutorial ("Getting Started with Fully Sharded Data Parallel"), ported
by changing its FSDP imports only (see TORCH_IMPORTS below) and shrunk to test size
(12x12 images, narrow layers, synthetic data, 2 epochs). tests/fsdp1/test_tutorial.py runs
this file as written and with torch's imports, and compares the numbers."""

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from plait.fsdp import FullStateDictConfig, StateDictType  # noqa: I001 - the lines the port changed
from plait.fsdp import FullyShardedDataParallel as FSDP
from plait.fsdp.wrap import size_based_auto_wrap_policy

PLAIT_IMPORTS = """from plait.fsdp import FullStateDictConfig, StateDictType  # noqa: I001 - the lines the port changed
from plait.fsdp import FullyShardedDataParallel as FSDP
from plait.fsdp.wrap import size_based_auto_wrap_policy
"""
TORCH_IMPORTS = """from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
"""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(128, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def train(model, rank, world_size, train_loader, optimizer, epoch, sampler=None):
    model.train()
    ddp_loss = torch.zeros(2)
    if sampler:
        sampler.set_epoch(epoch)
    for data, target in train_loader:
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target, reduction="sum")
        loss.backward()
        optimizer.step()
        ddp_loss[0] += loss.item()
        ddp_loss[1] += len(data)
    dist.all_reduce(ddp_loss, op=dist.ReduceOp.SUM)
    return (ddp_loss[0] / ddp_loss[1]).item()


def fsdp_main(rank, world_size, epochs=2):
    torch.manual_seed(1)
    dataset = TensorDataset(torch.randn(48, 1, 12, 12), torch.randint(10, (48,)))
    sampler1 = DistributedSampler(dataset, rank=rank, num_replicas=world_size, shuffle=True)
    train_loader = DataLoader(dataset, batch_size=4, sampler=sampler1)
    my_auto_wrap_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=100)

    model = Net()
    model = FSDP(model, auto_wrap_policy=my_auto_wrap_policy, device_id=torch.device("cpu"))  # cpu/gloo port
    optimizer = optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    torch.manual_seed(100 + rank)  # dropout: each rank its own masks (the same for both libraries)
    losses = []
    for epoch in range(1, epochs + 1):
        losses.append(train(model, rank, world_size, train_loader, optimizer, epoch, sampler=sampler1))
        scheduler.step()

    dist.barrier()
    # the tutorial's offload_to_cpu=True: torch's FSDP1 on a CPU-only machine then frees the
    # (already CPU) parameters it just gathered and fails; the state is on the CPU anyway
    save_policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
        cpu_state = model.state_dict()
    return losses, cpu_state
