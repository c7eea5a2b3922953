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

# the benchmark on the GPUs where there are GPUs, else on 8 CPU devices
bench: setup
	@if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then $(PY) -m jax_gin.bench; \
	else JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m jax_gin.bench; fi

clean:
	rm -rf build .venv
