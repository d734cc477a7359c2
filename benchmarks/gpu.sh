#!/usr/bin/env bash
# The GPU path in one go: tests/gpu (NCCL parity: DDP, FSDP2, TP, PP, a 2-D `plait train`) and
# the plait-vs-torch step-time table (benchmarks/bench_gpu.py) on the GPUs present, in at most
# 8 minutes (each part bounded by `timeout`), then one table. Without CUDA: says so, exits 0.
#   benchmarks/gpu.sh [--quick]
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "benchmarks/gpu.sh: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to run"
    exit 0
fi
"$PY" -c 'import torch; print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__}")'
tests_log=$(mktemp) bench_log=$(mktemp)
timeout 300 "$PY" -m pytest -q -rs tests/gpu -p no:cacheprovider >"$tests_log" 2>&1
tests_rc=$?
timeout 170 "$PY" -m benchmarks gpu ${1:-} >"$bench_log" 2>&1
bench_rc=$?
echo
echo "### tests/gpu (rc $tests_rc)"
echo
grep -E '(passed|failed|skipped|error)' "$tests_log" | tail -n 20
grep -E '^(FAILED|SKIPPED|ERROR)' "$tests_log"
sed -n '/^### GPU step time/,$p' "$bench_log"
[ "$bench_rc" -ne 0 ] && { echo "bench_gpu rc $bench_rc:"; tail -n 20 "$bench_log"; }
exit 0
