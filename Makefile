# Every target creates .venv on first use, so a fresh machine needs only `make demo` / `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0; a bare `torch` would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: venv demo test test-loaded test-stress bench clean gpu-wheels gpu-site test-gpu test-cores test-device

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

# the suite on a machine that is not quiet: `make test` three times in a row with two processes spinning beside it
# (tests/loaded.py starts and stops them); what a test asserts must not depend on how fast the machine is
test-loaded: venv
	$(PY) tests/loaded.py --busy 2 --times 3 -- $(MAKE) test

# the repeated-launch stress: ten runs per launcher instead of two (about 4 minutes)
test-stress: venv
	OMP_NUM_THREADS=1 FL_STRESS=1 $(PY) -m pytest -q tests/test_launch.py -k repeated_runs

bench: $(VENV)/.bench
	OMP_NUM_THREADS=1 $(PY) benchmarks/run.py --quick

# ---- the tiers for a lent GPU machine (docs/gpu.md) ----------------------------------------------------
# That machine reaches no network; its python3 (3.12) holds torch 2.11 with CUDA 13, lightning, transformers,
# pytest, but no torchrl, tensordict or Ray. `make gpu-wheels` (here) downloads what it lacks into .whl/ (ignored):
# the tier's packages, what `make test` needs beside them, and Ray's runtime packed; about 46 MiB, which travels
# with the work tree (8 MiB) under the device tool's 64 MiB. A session has 15 minutes of device time, a machine's
# start included, so the first call does what matters most within DEVICE_BUDGET, and a second, if time is left:
#   run(command="set -o pipefail; make test-device GPU_REPORTS=$OUT 2>&1 | tee $OUT/device.log", carry=[".whl"],
#       timeout_s=480)
#   run(command="set -o pipefail; make test-cores CORES_PARTS=suite CORES_BUDGET=240 GPU_REPORTS=$OUT 2>&1 | tee $OUT/suite.log",
#       carry=[".whl"], timeout_s=300)
# and commit the reports they send back (gpu_tier.json; cores.json: merge the two parts) under benchmarks/results/.
WHEELS := .whl
TIER_WHEELS := torchrl==0.14.1 tensordict==0.14.3 pyvers==0.2.3 hoptorch==0.1.4 importlib_metadata==10.2.0 \
	lazy-importer==0.1.0 orjson==3.13.0
SUITE_WHEELS := gymnasium==1.4.0 farama-notifications==0.0.6 mujoco==4.0.1 mujoco-core==4.0.1 mujoco-studio==4.0.1 \
	glfw==2.11.0 pyopengl==3.1.10 hydra-core==1.3.8 omegaconf==2.3.1
# Ray (RemoteLearner, tests/test_remote_learner.py, benchmarks/remote_learner.py) and what it needs beyond that
# machine's packages; its wheel (76 MiB) is over what travels, so benchmarks/gpu_tier.py --pack-ray packs the runtime (20 MiB).
RAY := ray==2.60.0
RAY_DEPS := jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
RAY_PACK := $(WHEELS)/ray-2.60.0-trimmed.tar.xz
PLATFORMS := $(foreach n,2_28 2_27 2_17,--platform manylinux_$(n)_x86_64) --platform manylinux2014_x86_64 \
	--platform manylinux1_x86_64 --platform any
DOWNLOAD := $(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	$(PLATFORMS)
GPU_PY ?= python3
GPU_SITE ?= /tmp/fl_site
GPU_REPORTS ?= benchmarks/results
TIER_ARGS ?=  # --dry-run: the CPU as the device
CORES_PARTS ?= async_save,remote_learner,suite
# seconds for test-cores' parts together (unset: no bound), and for test-device's install, tier and parts together
# (from make's start)
CORES_BUDGET ?=
DEVICE_BUDGET ?= 440
DEVICE_START := $(shell date +%s)
SITE_RUN = PYTHONPATH=$(GPU_SITE):$(CURDIR) OMP_NUM_THREADS=1 $(GPU_PY)

gpu-wheels:
	$(DOWNLOAD) -d $(WHEELS) $(TIER_WHEELS) $(SUITE_WHEELS) $(RAY_DEPS)
	$(PYTHON) -m pip wheel --quiet --no-deps -w $(WHEELS) antlr4-python3-runtime==4.9.3  # published as source only
	tmp=$$(mktemp -d) && $(DOWNLOAD) -d $$tmp $(RAY) && $(PYTHON) benchmarks/gpu_tier.py --pack-ray $$tmp/ray-*.whl $(RAY_PACK) \
		&& rm -rf $$tmp
	du -sh $(WHEELS)

# on the GPU machine: the carried wheels into $(GPU_SITE), beside the preinstalled torch (never replacing it)
gpu-site:
	if [ -d $(WHEELS) ]; then $(GPU_PY) -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
		--upgrade --target $(GPU_SITE) $(WHEELS)/*.whl; fi
	if [ -f $(RAY_PACK) ]; then $(GPU_PY) -m tarfile --filter data -e $(RAY_PACK) $(GPU_SITE); fi

# every CUDA check, one report (benchmarks/gpu_tier.py; `--dry-run` runs them on the CPU); within 8 minutes on one H100
test-gpu: gpu-site
	$(SITE_RUN) benchmarks/gpu_tier.py --report $(GPU_REPORTS)/gpu_tier.json $(TIER_ARGS)

# the checks that need spare cores (benchmarks/cores.py): refused, with the count needed, where there are too few
test-cores: gpu-site
	$(SITE_RUN) benchmarks/cores.py --parts $(CORES_PARTS) $(if $(CORES_BUDGET),--budget $(CORES_BUDGET)) --report $(GPU_REPORTS)/cores.json

# a lent machine's first call: the GPU tier (each check within 120 s), then the stall of an asynchronous save and
# RemoteLearner against SPMD in what is left of DEVICE_BUDGET; every report is written as it goes. Exits with the
# tier's status where it failed (2: no CUDA), else with the cores tier's
test-device: gpu-site
	$(SITE_RUN) benchmarks/gpu_tier.py --check-timeout 120 --report $(GPU_REPORTS)/gpu_tier.json $(TIER_ARGS); \
		gpu=$$?; $(SITE_RUN) benchmarks/cores.py --parts async_save,remote_learner --report $(GPU_REPORTS)/cores.json \
		--budget $$(( $(DEVICE_BUDGET) + $(DEVICE_START) - $$(date +%s) )); cores=$$?; exit $$(( gpu ? gpu : cores ))

clean:
	rm -rf $(VENV)
