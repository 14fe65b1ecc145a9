#!/usr/bin/env bash
# The GPU check: record the reference GPU figures the notebooks show and execute every notebook on the GPU.
#
#   benchmarks/gpu_check.sh                                        # on a machine with a CUDA GPU (< 8 minutes)
#   GPU_CHECK_ALLOW_CPU=1 benchmarks/gpu_check.sh --output x.json  # dry run on a CPU: every code path, tiny sizes
#
# Writes benchmarks/results/gpu_reference.json (copied to $OUT when set; executed notebooks to $OUT/executed/).
# Options (see benchmarks/gpu_check.py --help): --only SECTION..., --skip-notebooks, --budget SECONDS.
# Exit status: 0 all good, 1 a section or a notebook failed (the file says which), 2 nothing could run.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# Notebook kernels inherit this environment: course_utils imports even where it is not pip-installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "${GPU_CHECK_ALLOW_CPU:-0}" != "1" ] && command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || true
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
