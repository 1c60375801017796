# make run: set up, then a screening campaign through a resident worker.
# make test: set up, then the whole suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

PREFECT_PORT ?= 4200
WORK_POOL ?= resident-pool

BENCH_STAMP := $(VENV)/.bench-stamp

.PHONY: setup test test-fast run lint bench bench-full clean reliability gpu-check server worker deploy stack-up stack-down \
	stack-status docs docs-screenshots

setup: $(STAMP)

# --no-compile: pip would compile every module of every package (torch's and sympy's thousands among them);
# infra/precompile.py then compiles what this project's processes import (two processes at once), and a module first
# imported later is compiled then and kept (below). Measured on this 2-core machine: pip 43 s with --no-compile
# against 82 s with its own compiling.
INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check --no-compile

# A current pip first: the one a new venv carries (23.2 with Python 3.11.7) weighs every release in each index page
# it reads (Prefect's alone lists thousands of files), 31 s of resolving here against 13 s for pip 26.3, which
# installs the whole set in 33 s against 48 s.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(INSTALL) "pip>=25.3"
	$(INSTALL) -e ".[prefect,demo,test]"
	$(PY) infra/precompile.py
	touch $(STAMP)

# Test processes at once: the tests wait on real processes and sockets more than they compute. On this project's
# 2-core machine, fresh clones of one commit (877cccb): the tests' phase took 570 s with 4 (the cores busy 89% of
# it) and 529 s with 5 (95%).
# --dist loadgroup: each file listed in tests/scheduling.py runs whole on one of them.
JOBS ?= 5
# Every process make starts writes bytecode, even where the shell says not to (PYTHONDONTWRITEBYTECODE): setup
# compiles nothing (above), and without a cache each of the hundreds of pools, workers, flow runs and CLIs a run
# starts would compile what it imports again (a full run: 11 min 18 s with the cache, 12 min 49 s with only the
# package compiled first). Python trusts a cached module whose source has the same size and whole second: a test
# that rewrites a module it imported moves the file's time a second on (tests/test_zygote.py, test_forked_runs.py).
unexport PYTHONDONTWRITEBYTECODE
PYTEST := $(PY) -m pytest

# Every test but load and soak at size (those are `make reliability`), in JOBS processes.
test: setup
	$(PYTEST) -n $(JOBS) --dist loadgroup -m "not soak" --durations=25

# Before every commit: the unit tests and the decision core, plus a few real paths through a pool (smoke).
test-fast: setup
	$(PYTEST) -n $(JOBS) --dist loadgroup -m "(not e2e or smoke) and not soak"

# Faults, hostile input, isolation, load and soak; prints the reliability table at the end.
reliability: setup
	RESIDENT_POOL_FULL_RELIABILITY=1 $(PYTEST) -n $(JOBS) --dist loadgroup -m reliability tests/test_reliability.py tests/test_lifecycle.py tests/test_hostile.py tests/test_isolation.py tests/test_security.py \
		tests/test_admission_service.py tests/test_campaign.py tests/test_stack.py tests/test_ui.py tests/test_suite_machinery.py tests/test_kept_lease_reliability.py

lint: setup
	$(PY) -m ruff check resident_pool tests flows bench
	$(PY) -m mypy

# Prefect's temporary server would otherwise try to send telemetry from an offline host,
# and its first start on a new machine (database migrations) can outlast the default 20 s.
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180

run: setup
	$(PY) flows/screen.py --output out/uniprot-500.fasta.minilm.jsonl
	$(VENV)/bin/resident-pool status

# A local Prefect stack by hand, one terminal each (`make stack-up` does all three, and starts the events relay;
# `make stack-down` stops them, the relay, and the resident pool with its model workers). Each takes the
# API's auth string from .stack/auth (made on first use, 0600): the server refuses whoever lacks it.
export PREFECT_PORT WORK_POOL
server: setup
	infra/local/stack.sh server

worker: setup
	infra/local/stack.sh worker

deploy: setup
	infra/local/stack.sh deploy

$(BENCH_STAMP): $(STAMP)
	$(INSTALL) -e ".[prefect,demo,test,bench]"
	touch $(BENCH_STAMP)

# Ratios against baselines measured in the same run; writes bench/results/latest.json.
# bench: about 10 minutes; bench-full adds the million-input campaign (about 15 minutes more). Same table.
bench: $(BENCH_STAMP)
	$(PY) bench/run.py

bench-full: $(BENCH_STAMP)
	$(PY) bench/run.py --full

# On a host with an NVIDIA GPU and a CUDA torch (bench/gpu/README.md); elsewhere it says so and exits 0.
gpu-check: setup
	$(PY) bench/gpu_check.py

stack-up: setup
	infra/local/stack.sh up

stack-down:
	infra/local/stack.sh down

# The manual (docs/, MkDocs with the Material theme) as a static site in site/; the suite builds it --strict too.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The manual's UI screenshots (docs/img/) from a stack of their own on a free port; never run by a test.
docs-screenshots: setup
	$(PY) infra/local/docs_screenshots.py
stack-status:
	infra/local/stack.sh status

clean:
	rm -rf $(VENV) .pytest_cache site
