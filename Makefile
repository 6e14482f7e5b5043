# Every target creates .venv on first use, so a fresh machine needs only `make demo` / `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0; a bare `torch` would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: venv demo test test-stress bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

# matplotlib (plots of benchmarks and examples' --plot) stays out of the test install: torchmetrics,
# which lightning imports, loads it whenever it is installed, in every process a test starts
$(VENV)/.bench: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[bench]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	OMP_NUM_THREADS=1 $(PY) examples/ppo_pendulum.py

# the linter first (its settings are in pyproject.toml), then two workers, each taking whole modules (their launches share module fixtures) in the order
# tests/conftest.py gives them (xdist would otherwise reorder them by their number of tests)
test: venv
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# the repeated-launch stress: ten runs per launcher instead of two (about 4 minutes)
test-stress: venv
	OMP_NUM_THREADS=1 FL_STRESS=1 $(PY) -m pytest -q tests/test_launch.py -k repeated_runs

bench: $(VENV)/.bench
	OMP_NUM_THREADS=1 $(PY) benchmarks/run.py --quick

clean:
	rm -rf $(VENV)
