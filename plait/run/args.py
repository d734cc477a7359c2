"""`plait run`'s command line: torchrun's flags, in both spellings, into a `LaunchConfig`.

    plait run [--nnodes MIN:MAX] [--nproc-per-node N] [...] train.py [script args...]

Each flag takes `--dash-form` and `--underscore_form`, and like torchrun falls back to the
environment variable `PET_<FLAG>` (`PET_NPROC_PER_NODE=4`), so cluster recipes written for
torchrun (Kubeflow, SLURM wrappers) work unchanged. The few torchrun flags plait does not
implement are accepted by name and rejected with a message, never silently ignored.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid

from plait.run.config import (
    RDZV_CONF_DEFAULTS,
    LaunchConfig,
    LaunchError,
    LogConfig,
    RendezvousConfig,
    parse_nnodes,
    parse_nproc,
    parse_ranks_filter,
    parse_rdzv_conf,
    parse_signals,
    parse_std,
)
from plait.run.net import parse_endpoint

DEFAULT_C10D_PORT = 29400  # torchrun's default for an endpoint given without a port
DEFAULT_MASTER_PORT = 29500
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap.py")
_UNSUPPORTED = ("--logs-specs", "--numa-binding", "--event-log-handler",
                "--duplicate-stdout-filters", "--duplicate-stderr-filters")


def _env_default(dest: str, default):
    return os.environ.get(f"PET_{dest.upper()}", default)


def _flag_default(dest: str) -> bool:
    return os.environ.get(f"PET_{dest.upper()}", "0").strip().lower() not in ("", "0", "false", "no")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plait run",
        description="Launch a distributed job: one worker per local rank on each node (torchrun's flags).",
        allow_abbrev=False,
    )

    def opt(name: str, *, short: str | None = None, default=None, **kw):
        dest = name.replace("-", "_")
        flags = ([short] if short else []) + [f"--{name}"] + ([f"--{dest}"] if "-" in name else [])
        p.add_argument(*flags, dest=dest, default=_env_default(dest, default), **kw)

    def flag(name: str, *, short: str | None = None, help: str):
        dest = name.replace("-", "_")
        flags = ([short] if short else []) + [f"--{name}"] + ([f"--{dest}"] if "-" in name else [])
        p.add_argument(*flags, dest=dest, action="store_true", default=_flag_default(dest), help=help)

    opt("nnodes", default="1:1", help="number of nodes, or a range MIN:MAX for an elastic job")
    opt("nproc-per-node", default="1", help="workers per node: an integer, cpu, gpu, xpu or auto")
    flag("standalone", help="single node: rendezvous locally on a free port, no endpoint needed")
    opt("node-rank", default=0, type=int, help="this node's rank (static rendezvous only)")
    opt("master-addr", default="127.0.0.1", help="rank 0's node (static rendezvous)")
    opt("master-port", default=None, type=int,
        help=f"static rendezvous port on --master-addr (default {DEFAULT_MASTER_PORT}; "
             "one node: a free port unless given)")
    opt("local-addr", default=None, help="this node's address as other nodes reach it")
    opt("rdzv-backend", default="static", help="c10d (elastic) or static (fixed --node-rank)")
    opt("rdzv-endpoint", default="", help=f"HOST[:PORT] of the c10d rendezvous store (port {DEFAULT_C10D_PORT})")
    opt("rdzv-id", default="none", help="job id; agents with the same id form one job")
    opt("rdzv-conf", default="", help="KEY=VALUE,...: " + ", ".join(RDZV_CONF_DEFAULTS) + ", is_host")
    opt("max-restarts", default=0, type=int, help="job-wide restarts of the worker group before failing")
    opt("monitor-interval", default=0.1, type=float, help="seconds between checks of the workers")
    opt("shutdown-timeout", default=None, type=float,
        help="seconds between SIGTERM and SIGKILL when stopping workers (default 30)")
    opt("signals-to-handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="signals that stop every worker and then the launcher")
    opt("start-method", default="spawn", choices=["spawn", "fork", "forkserver"],
        help="accepted for torchrun compatibility: scripts always run as new processes")
    opt("role", default="default", help="the workers' role name (ROLE_NAME)")
    flag("module", short="-m", help="run the target as a module, like python -m")
    flag("no-python", help="exec the target directly instead of with python")
    flag("run-path", help="run the script with runpy.run_path (what plait always does for python)")
    opt("log-dir", default=None, help="keep each rank's stdout/stderr per attempt under this directory")
    opt("redirects", short="-r", default="0",
        help="send std streams to files only: 0 none, 1 stdout, 2 stderr, 3 both, or 0:1,1:2 per local rank")
    opt("tee", short="-t", default="0", help="copy std streams to files as well as the console (same values)")
    opt("local-ranks-filter", default="", help="show only these local ranks on the console, e.g. 0,1")
    opt("log-line-prefix-template", default=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        help="prefix for each console line; ${rank}, ${local_rank}, ${role_name}, ${node}")
    flag("virtual-local-rank", help="LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES set to its device")
    for name in _UNSUPPORTED:
        dest = name[2:].replace("-", "_")
        p.add_argument(name, f"--{dest}", dest=dest, default=None, help=argparse.SUPPRESS)
    p.add_argument("training_script", help="the script (or module with -m, program with --no-python)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def parse_config(argv: list[str]) -> LaunchConfig:
    """Parse and check `argv`; raises LaunchError (or SystemExit(2) from argparse) on a mistake."""
    ns = build_parser().parse_args(argv)
    for name in _UNSUPPORTED:
        if getattr(ns, name[2:].replace("-", "_")) is not None:
            raise LaunchError(f"{name} is a torchrun extension that plait run does not implement")

    min_nodes, max_nodes = parse_nnodes(str(ns.nnodes))
    nproc = parse_nproc(str(ns.nproc_per_node))
    conf, is_host = parse_rdzv_conf(ns.rdzv_conf)
    if ns.max_restarts < 0:
        raise LaunchError(f"--max-restarts {ns.max_restarts}: must be 0 or more")
    if ns.monitor_interval <= 0:
        raise LaunchError(f"--monitor-interval {ns.monitor_interval}: must be positive")
    if ns.master_port is not None and not 0 <= ns.master_port <= 65535:
        raise LaunchError(f"--master-port {ns.master_port}: not a port number (0-65535)")

    backend, host, port, run_id = _rendezvous_endpoint(ns, min_nodes, max_nodes)
    if max_nodes > 1 and port == 0:
        raise LaunchError(f"{'--rdzv-endpoint' if backend == 'c10d' else '--master-port'} port 0: "
                          f"the other nodes need a fixed port to find the rendezvous store")
    if ns.module and ns.no_python:
        raise LaunchError("--module and --no-python cannot be used together")
    command, name = _worker_command(ns)
    shutdown = ns.shutdown_timeout
    if shutdown is None:
        shutdown = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30))
    if shutdown < 0:
        raise LaunchError(f"--shutdown-timeout {shutdown}: must be 0 or more")

    rdzv = RendezvousConfig(
        backend=backend, host=host, port=port, run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes,
        node_rank=ns.node_rank if backend == "static" else 0, local_addr=ns.local_addr,
        join_timeout=conf["join_timeout"], last_call_timeout=conf["last_call_timeout"],
        close_timeout=conf["close_timeout"], read_timeout=conf["timeout"],
        keep_alive_interval=conf["keep_alive_interval"],
        keep_alive_max_attempt=max(1, int(conf["keep_alive_max_attempt"])), is_host=is_host,
    )
    logs = LogConfig(
        log_dir=ns.log_dir, redirects=parse_std("--redirects", ns.redirects), tee=parse_std("--tee", ns.tee),
        local_ranks_filter=parse_ranks_filter(ns.local_ranks_filter),
        prefix_template=ns.log_line_prefix_template,
    )
    single_addr = parse_endpoint(ns.master_addr, default_port=0, flag="--master-addr")[0]
    return LaunchConfig(
        rdzv=rdzv, logs=logs, nproc_per_node=nproc, max_restarts=ns.max_restarts,
        monitor_interval=ns.monitor_interval, shutdown_timeout=shutdown, role=ns.role,
        command=command, name=name,
        master_addr="127.0.0.1" if ns.standalone else single_addr,
        master_port=None if ns.standalone else ns.master_port,
        signals=parse_signals(ns.signals_to_handle), virtual_local_rank=ns.virtual_local_rank,
    )


def _rendezvous_endpoint(ns: argparse.Namespace, min_nodes: int, max_nodes: int) -> tuple[str, str, int, str]:
    """(backend, host, port, run id) of the rendezvous store, as torchrun derives them."""
    backend, run_id = ns.rdzv_backend, ns.rdzv_id
    if ns.standalone:
        if (min_nodes, max_nodes) != (1, 1):
            raise LaunchError(f"--standalone runs one node, but --nnodes is {ns.nnodes}")
        return "c10d", "127.0.0.1", 0, str(uuid.uuid4())
    if backend == "static":
        if min_nodes != max_nodes:
            raise LaunchError(
                f"--nnodes {ns.nnodes}: static rendezvous needs a fixed node count; "
                f"use --rdzv-backend c10d for an elastic MIN:MAX job"
            )
        if not 0 <= ns.node_rank < max_nodes:
            raise LaunchError(f"--node-rank {ns.node_rank}: must be in [0, {max_nodes}) for --nnodes {max_nodes}")
        if ns.rdzv_endpoint:
            host, port = parse_endpoint(ns.rdzv_endpoint, default_port=DEFAULT_MASTER_PORT, flag="--rdzv-endpoint")
        else:
            host = parse_endpoint(ns.master_addr, default_port=0, flag="--master-addr")[0]
            port = ns.master_port if ns.master_port is not None else DEFAULT_MASTER_PORT
        return backend, host, port, run_id
    if backend == "c10d":
        if ns.rdzv_endpoint:
            host, port = parse_endpoint(ns.rdzv_endpoint, default_port=DEFAULT_C10D_PORT, flag="--rdzv-endpoint")
            return backend, host, port, run_id
        if max_nodes == 1:
            return backend, "127.0.0.1", 0, run_id
        raise LaunchError("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT for more than one node")
    if backend in ("etcd", "etcd-v2"):
        raise LaunchError(f"--rdzv-backend {backend}: not supported; use c10d (a TCPStore on one node)")
    raise LaunchError(f"--rdzv-backend {backend!r}: expected c10d or static")


def _worker_command(ns: argparse.Namespace) -> tuple[tuple[str, ...], str]:
    target, args = ns.training_script, list(ns.training_script_args)
    if args and args[0] == "--":
        args = args[1:]
    if ns.no_python and not ns.run_path:
        program = target if os.sep in target else shutil.which(target)
        if not program or not os.path.isfile(program) or not os.access(program, os.X_OK):
            raise LaunchError(f"--no-python {target!r}: no such executable (cwd {os.getcwd()})")
        return (program, *args), os.path.basename(target)
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if ns.module:
        return (python, "-u", BOOTSTRAP, "-m", target, *args), target
    if not os.path.exists(target):
        raise LaunchError(f"script {target!r} not found (cwd {os.getcwd()})")
    return (python, "-u", BOOTSTRAP, target, *args), os.path.basename(target)
