# The two quick-start commands live here: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: run test test-long lint cluster bench faults clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.test-installed: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $@ $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/python -m mqttring.node --mqtt 127.0.0.1:1883 --data-dir ./data

# Two test processes (pytest-xdist): most cluster tests wait on timers, not CPU; on 2 cores
# the suite took 25:21 in one process and 15:42 in two.  `pytest tests/x.py` still runs in one.
test: $(VENV)/.test-installed
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q -n 2

# The randomized searches that `make test` keeps short, run long (~15 minutes on 2 cores):
# random programs against a 3-node cluster and one broker side by side, SIGKILL rounds
# against the store.
test-long: $(VENV)/.test-installed
	MQTTRING_MODEL_EXAMPLES=200 $(BIN)/python -m pytest -q tests/test_cluster_model.py
	LSM_CRASH_SECONDS=300 $(BIN)/python -m pytest -q tests/test_lsm_crash.py

lint: $(VENV)/.test-installed
	$(BIN)/ruff check src tests benchmarks

cluster: $(VENV)/.installed
	$(BIN)/python -m mqttring.devcluster --nodes 3 --data-dir ./data/cluster

bench: $(VENV)/.test-installed
	$(BIN)/python -m benchmarks compare --quick

# The fault suite (root: network namespaces + nftables; docs/faults.md): 3 and 5 nodes, every
# scenario (power loss, join and leaves included), ~13 minutes.  Exit status non-zero when a
# contract check fails; the report is written either way.
faults: $(VENV)/.test-installed
	PYTHONPATH=src:. $(BIN)/python -m tests.faults.run --nodes 3,5 --scenario all \
	  --out tests/faults/results/latest --md docs/faults-report.md \
	  --json tests/faults/results/faults.json

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
