#!/usr/bin/env bash
# The GPU check: one run on a CUDA GPU machine, no download (tokenflow/tools/gpu_check.py
# says what it does). Needs the official CUDA vLLM: `make install EXTRA=gpu`.
# Extra arguments go to `tokenflow gpu-check` (e.g. --skip-bench, --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then
  echo "gpu_check: $PY not found; run 'make install EXTRA=gpu' first" >&2
  exit 2
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA GPU visible to torch; 'tokenflow gpu-check --tiny' is the CPU dry run" >&2
  exit 2
fi
exec "$PY" -m tokenflow.tools.gpu_check "$@"
