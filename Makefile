# `make serve` and `make test` bootstrap everything they need, once.
# EXTRA=gpu installs the official CUDA vLLM instead of the CPU build.
EXTRA ?= cpu
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(EXTRA)
MODEL ?= models/tiny-llama
CONFIG ?= configs/local.yaml
PYTEST_ARGS ?=

PROMETHEUS ?= /usr/bin/prometheus

.PHONY: install model serve test clean prometheus tcmalloc

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -e '.[$(EXTRA),dev]'
	@# PyPI's torchvision/torchaudio/torchcodec break `import transformers`
	@# next to the CPU torch build; text models do not need them.
	@if [ "$(EXTRA)" = "cpu" ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true; fi
	@# Bytecode is compiled once here, on every core (pip compiles on one:
	@# 212 s of install against 170 s on 2 cores), since PYTHONDONTWRITEBYTECODE
	@# may keep each process from caching it later. As with pip, a file this
	@# Python cannot compile (torch ships 3.12-only test files) is left alone.
	@$(PY) -m compileall -qq -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || true
	@touch $(STAMP)

model: $(MODEL)/model.safetensors

$(MODEL)/model.safetensors: $(STAMP)
	$(VENV)/bin/tokenflow tiny-model $(MODEL)

# vLLM's CPU engines keep their memory flat only with tcmalloc (glibc's
# malloc fragments: docs/RELIABILITY.md). Debian's package, installed once
# where root (or sudo) is at hand; without it the app still runs, with a note.
tcmalloc:
	@[ "$(EXTRA)" != cpu ] || ldconfig -p | grep -q libtcmalloc_minimal || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  { $$SUDO apt-get update -qq && \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4; } \
	  || echo "note: libtcmalloc-minimal4 not installed; engines use glibc malloc (memory creeps, see docs/RELIABILITY.md)"; }

serve: install model tcmalloc
	$(VENV)/bin/tokenflow serve $(CONFIG)

# tests/test_observability.py scrapes the app with a real Prometheus:
# Debian's package (2.42), installed once (as root, or through sudo).
prometheus:
	@test -x $(PROMETHEUS) || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

test: install model prometheus tcmalloc
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) models
