# The compose deployment's end-to-end test; included from the Makefile (it uses BIN, STAMP and
# GEN_STAMP from there):   make test-compose
#
# From a bare Debian machine as root: installs docker.io, docker-compose and debootstrap when
# missing, starts dockerd when no engine answers, makes the local base image (cached: kept
# between runs), puts the CPU torch wheel into docker/wheelhouse when one is at hand, then runs
# tests/e2e, which builds the kvfleet image, renders every compose variant, brings the stack up
# (the real model), tests it and tears it down, then the same with TLS on (the tiny model).
# Where python:3.11-slim can be pulled: make test-compose COMPOSE_BASE_IMAGE=python:3.11-slim

COMPOSE_BASE_IMAGE ?= kvfleet-base:bookworm
COMPOSE_IMAGE ?= kvfleet:e2e
TORCH_CPU_WHEEL := torch==2.13.0+cpu
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: test-compose docker-engine docker-base-image docker-wheelhouse

docker-engine:
	@command -v dockerd >/dev/null && command -v docker-compose >/dev/null && command -v debootstrap >/dev/null \
	  || { $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q docker.io docker-compose debootstrap; }
	@docker info >/dev/null 2>&1 || { \
	  echo "starting dockerd (log: /tmp/dockerd.log)"; \
	  $(SUDO) setsid dockerd > /tmp/dockerd.log 2>&1 < /dev/null & \
	  for i in $$(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done; \
	  docker info >/dev/null 2>&1 || { tail -n 30 /tmp/dockerd.log; echo "dockerd did not come up"; exit 1; }; }

docker-base-image: docker-engine
	@case "$(COMPOSE_BASE_IMAGE)" in \
	  kvfleet-base:*) $(SUDO) docker/make_base_image.sh $(COMPOSE_BASE_IMAGE) ;; \
	  *) echo "base image $(COMPOSE_BASE_IMAGE) comes from its registry" ;; \
	esac

# The CPU wheel only: PyPI's torch is the CUDA build. Without one at hand (a find-links folder
# or a pip index that has it) the image build fetches it from PyTorch's CPU index instead.
docker-wheelhouse: $(STAMP)
	@ls docker/wheelhouse/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 \
	  || $(BIN)/pip download -q --no-deps -d docker/wheelhouse '$(TORCH_CPU_WHEEL)' \
	  || echo "no $(TORCH_CPU_WHEEL) wheel at hand; the image build gets it from download.pytorch.org"

test-compose: install docker-base-image docker-wheelhouse
	@# -I: the repository's docker/ folder must not pass for the docker SDK
	@$(BIN)/python -I -c "from docker import from_env; import yaml" 2>/dev/null || $(BIN)/pip install -q docker pyyaml
	KVFLEET_E2E=1 KVFLEET_BASE_IMAGE=$(COMPOSE_BASE_IMAGE) KVFLEET_IMAGE=$(COMPOSE_IMAGE) \
	  $(BIN)/python -m pytest tests/e2e -v -rs -p no:cacheprovider --timeout=1200
