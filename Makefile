# mpsync — the only commands a user or CI needs.
#   make setup   install everything on a bare Debian 12 machine (root, idempotent)
#   make demo    the main job: compare every policy on the embedded default (digits, 4 workers)
#   make test    the whole test suite (runs setup first if needed)
VENV      ?= .venv
PY        := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test bench doctor slurm clean

setup:
	bash .ci/setup.sh

$(VENV)/.mpsync-setup/deps:
	bash .ci/setup.sh

doctor: setup
	$(VENV)/bin/mpsync doctor

demo: setup
	$(PY) -m mpsync.apps.compare --out bench/compare

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info .pytest_cache
