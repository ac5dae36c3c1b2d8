# The two commands of the README:
#   make docs   build the user guide (every recipe executed) into build/html
#   make test   run the whole test suite (unit, multi-rank, doctests, the strict docs build)
# Both create .venv when it is missing.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The docs build never needs the network; set MFSDP_DOCS_OFFLINE=0 to resolve intersphinx links.
export MFSDP_DOCS_OFFLINE ?= 1

.PHONY: docs test venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned: any other spec pulls CUDA builds on a CPU-only machine
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[docs,test]"
	touch $@

venv: $(VENV)/.installed

docs: $(VENV)/.installed
	$(PY) -m sphinx -b html -W --keep-going -j 1 . build/html
	@echo "The guide is in build/html/index.html"

test: $(VENV)/.installed
	$(PY) -m pytest

clean:
	rm -rf build docs/recipes docs/generated
