# The two commands of the README:
#   make docs   build the user guide (every recipe executed) into build/html
#   make test   run the test suite (unit, multi-rank, the guide's doctests), under 25 minutes
#   make test-extended   the long cross-checks (the strict docs build with every recipe and the
#                        browser checks, 8-rank EP with HSDP, the 1 GiB streaming conversion,
#                        the smoke script and preemption under Slurm, conversion over torchrun
#                        ranks, a Megatron-LM EP 2 checkpoint resumed at EP 2, checkpoints
#                        resharded across TP sizes); CI runs both
# Both create .venv when it is missing.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The docs build never needs the network; set MFSDP_DOCS_OFFLINE=0 to resolve intersphinx links.
export MFSDP_DOCS_OFFLINE ?= 1

# Mermaid (the diagrams' renderer) is fetched from the npm registry once, so that the built guide
# renders its diagrams offline; without npm the pages load mermaid from its CDN instead.
MERMAID_VERSION ?= 11.12.1
VENDOR := build/vendor

.PHONY: docs serve test test-extended test-gpu venv vendor clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned to the tested version. From PyPI, on Linux, that is the CUDA build
	# (it runs on CPUs too). A build installed into .venv beforehand (the CPU build from
	# PyTorch's index, docs/quickstart.md) satisfies the pin and is kept.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[docs,test]"
	touch $@

venv: $(VENV)/.installed

$(VENDOR)/mermaid/mermaid.esm.min.mjs:
	@if command -v npm >/dev/null 2>&1; then \
	  rm -rf $(VENDOR)/tmp && mkdir -p $(VENDOR)/tmp && \
	  (cd $(VENDOR)/tmp && npm pack mermaid@$(MERMAID_VERSION) --silent >/dev/null) && \
	  tar xzf $(VENDOR)/tmp/mermaid-$(MERMAID_VERSION).tgz -C $(VENDOR)/tmp --wildcards \
	    'package/dist/mermaid.esm.min.mjs' 'package/dist/chunks/mermaid.esm.min/*.mjs' && \
	  rm -rf $(VENDOR)/mermaid && mv $(VENDOR)/tmp/package/dist $(VENDOR)/mermaid && \
	  rm -rf $(VENDOR)/tmp; \
	else echo "npm not found: the guide's diagrams will load mermaid from its CDN"; fi

vendor: $(VENDOR)/mermaid/mermaid.esm.min.mjs

docs: $(VENV)/.installed vendor
	$(PY) -m sphinx -b html -E -W --keep-going -j 1 . build/html  # -E: every page gets the current navigation
	@$(PY) docs/_ext/recipe_times.py
	@echo "The guide is in build/html: read it with 'make serve' at http://localhost:8000"
	@echo "(opened as a file, the diagrams and the planner's calculator do not load)"

# The built guide over http://localhost:8000 (browsers load the diagrams' module script and
# the planner calculator's tables from http:// but not from file://).
serve:
	$(PY) -m http.server --directory build/html 8000

test: $(VENV)/.installed
	$(PY) -m pytest

test-extended: $(VENV)/.installed vendor
	$(PY) -m pytest -m extended

# On a machine with a CUDA GPU: the NCCL/CUDA suite (tests/gpu). Elsewhere every test skips.
test-gpu: $(VENV)/.installed
	$(PY) -m pytest -m gpu tests/gpu -rs

clean:
	rm -rf build/html build/test-html docs/recipes docs/generated
