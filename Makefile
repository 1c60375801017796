# make run: set up, then a screening campaign through a resident worker.
# make test: set up, then the whole suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup test run lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[prefect,demo,test]"
	touch $(STAMP)

test: setup
	$(PY) -m pytest

lint: setup
	$(PY) -m ruff check resident_pool tests flows

# Prefect's temporary server would otherwise try to send telemetry from an offline host.
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

run: setup
	$(PY) flows/screen.py
	$(VENV)/bin/resident-pool status

clean:
	rm -rf $(VENV) .pytest_cache
