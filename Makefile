# make demo : set up everything, then run the demo (the devices present; 8 CPU devices by default)
# make test : set up everything, then run the test suite (8 CPU devices; JAX_PLATFORMS=cuda for GPUs)
PY := .venv/bin/python

.PHONY: setup demo test bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) -m jax_gin.bench

clean:
	rm -rf build .venv
