# mpsync — the only commands a user or CI needs.
#   make setup   install everything on a bare Debian 12 machine (root, idempotent)
#   make demo    the main job: compare every policy on the embedded default (digits, 4 workers),
#                into a new runs/compare-<date>-<time>
#   make test    the whole test suite (runs setup first if needed)
#   make slurm   start a single-node Slurm here and submit the job templates to it
#   make gpu-check  the CUDA paths on a machine with a GPU (DEVICE=cpu: the same steps on CPU)
VENV      ?= .venv
PY        := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo bench-compare test bench doctor slurm gpu-check clean

setup:
	bash .ci/setup.sh

$(VENV)/.mpsync-setup/deps:
	bash .ci/setup.sh

doctor: setup
	$(VENV)/bin/mpsync doctor

# The demo writes to a new runs/compare-<date>-<time> (ignored by git); bench-compare is the
# same comparison refreshing the result set committed under bench/compare, on purpose.
DEMO_ARGS := --repeats 2 --time-budget 20 --stop-at-target

demo: setup
	$(PY) -m mpsync.apps.compare $(DEMO_ARGS)

bench-compare: setup
	$(PY) -m mpsync.apps.compare --out bench/compare $(DEMO_ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# A real single-node Slurm on this machine (Debian's slurm-wlm + munge), then the Slurm tests.
slurm: setup
	bash .ci/slurm.sh start
	$(PY) -m pytest tests/test_slurm.py $(PYTEST_ARGS)

# Needs no `make setup`: a GPU machine brings its own CUDA torch, numba, mpi4py and pytest, so
# the venv's Python is used only where it exists.
DEVICE    ?= cuda
GPU_PY    ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) .ci/gpu_check.py --device $(DEVICE)

clean:
	rm -rf build *.egg-info .pytest_cache
