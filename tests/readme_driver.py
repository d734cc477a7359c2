"""Run several README examples in one `plait run` launch, each as its own script in a fork.

    plait run --standalone --nproc-per-node 2 readme_driver.py comm.py ddp.py ...
    plait run --standalone --nproc-per-node 2 readme_driver.py dcp::fsdp2.py::--dcp-api dcp::fsdp2.py::--dcp-api

A plain PATH runs in ./<its stem>/ with no arguments; NAME::PATH::ARG::... runs in ./NAME/ with
sys.argv [PATH, ARG, ...], so that two runs of one script can share a folder (a second that
resumes from the first's checkpoint: tests/examples/test_torch_examples.py).

tests/test_readme.py launches this once per rank count instead of once per example: a worker
that starts pays `import torch` and `torch._dynamo` (~3 CPU s) and the interpreter's exit-time
GC of their objects (~0.8 CPU s); an example itself costs a fraction of that. Per example:

    worker (torch + torch._dynamo imported, gc.freeze()) --fork--> child: own cwd, sys.argv,
    sys.path[0]; rank 0 hosts a fresh TCPStore and names its port in the agent's store ->
    the example runs as `__main__` (its `comm.init_process_group()` reads RANK, WORLD_SIZE,
    MASTER_ADDR from the launcher, MASTER_PORT now the fresh store's) -> normal interpreter exit
    (atexit hooks, plait's Gloo shutdown) -> the worker prints "README example NAME: rank R exit 0"

Why a fork and a fresh store: c10d's keys in a store are the same for every default group
(`default_pg/0/...`), so a second `init_process_group` on the agent's store reads the first
group's stale Gloo addresses (measured: "Connection reset by peer" at the second all-reduce);
`plait run` itself gives each round a fresh store, as this does each example. The fork gives each
example a process of its own (no state left from the one before, its own exit); only torch's
modules are shared, imported before the fork and frozen so that no child's exit walks them.
plait is imported by each example, as in a fresh process.

A failed example (any exit but 0) ends this worker with exit 1, so `plait run` stops the job;
its children die with it (PR_SET_PDEATHSIG).
"""

import atexit
import ctypes
import gc
import os
import runpy
import sys
import time
from datetime import timedelta

import torch
import torch._dynamo  # noqa: F401  (torch's optimizers import it at their first step)
from torch.distributed import TCPStore

_PR_SET_PDEATHSIG, _SIGKILL = 1, 9
TIMEOUT = timedelta(seconds=240)  # test_readme.py's bound on one launch
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
_keep = []  # rank 0's store for this child's example: alive until the child exits


def _agent_store() -> TCPStore:
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=TIMEOUT)


def _spec(arg: str) -> tuple[str, str, list[str]]:
    """NAME::PATH::ARG... or PATH (NAME its stem, no arguments) -> (name, path, args)."""
    if "::" not in arg:
        return os.path.splitext(os.path.basename(arg))[0], arg, []
    name, path, *args = arg.split("::")
    return name, path, args


def _run_child(index: int, name: str, path: str, args: list[str]) -> None:
    """In the fork: host (rank 0) or find this example's store, run the example, wait at exit
    until every rank's example is done before rank 0's store goes away."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, _SIGKILL)
    agent = _agent_store()
    key = f"readme_driver/{index}"
    if RANK == 0:
        store = TCPStore(os.environ["MASTER_ADDR"], 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        _keep.append(store)
        agent.set(f"{key}/port", str(store.port))
    os.environ["MASTER_PORT"] = agent.get(f"{key}/port").decode()

    def done() -> None:  # registered before the example's own hooks, so it runs after them
        agent.set(f"{key}/done/{RANK}", "1")
        if RANK == 0:
            agent.wait([f"{key}/done/{r}" for r in range(WORLD)])

    atexit.register(done)
    os.makedirs(name, exist_ok=True)
    os.chdir(name)
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(path)  # what `python example.py` puts first
    runpy.run_path(path, run_name="__main__")


def main(specs: list[str]) -> None:
    # a line a write, here and in the forks (they inherit it): the ranks share one pipe, and
    # torchrun starts its workers with `python -u` (write-through: print's text and its newline
    # are two writes), so another rank's line landed between them ("rank 0 step 6 loss ...rank 1
    # step 6 loss ..." then an empty line; "rank 5 exit 0README example mesh: rank 4 exit 0")
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    gc.freeze()  # torch's objects: shared with the children, never walked by their exit-time GC
    for index, spec in enumerate(specs):
        name, path, args = _spec(spec)
        pid = os.fork()
        if pid == 0:
            _run_child(index, name, os.path.abspath(path), args)
            sys.exit(0)  # the normal exit a script has (an exception propagates the same way)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(f"README example {name}: rank {RANK} exit {code}", flush=True)
        if code != 0:
            time.sleep(1)  # let the other ranks print theirs
            sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
