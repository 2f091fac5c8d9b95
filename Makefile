# Two commands are all the set-up there is: `make train` and `make test`.
# Both create (or reuse) .venv from Python 3.12 and install the project into it. Keep the
# bytecode pip writes (no --no-compile): under PYTHONDONTWRITEBYTECODE nothing else writes it,
# and every process of a test run would compile jax and the rest from source.
PYENV_PY := $(shell pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12
PY ?= $(shell command -v python3.12 2>/dev/null || (test -x $(PYENV_PY) && echo $(PYENV_PY)) || echo python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: train test docs test-lowest test-slurm gpu-bundle torch-parity lint typecheck venv clean

$(STAMP): pyproject.toml
	@$(PY) -c 'import sys; assert sys.version_info >= (3, 12), f"meshtrain needs Python >= 3.12, got {sys.version.split()[0]} from $(PY); install 3.12 (pyenv install 3.12) or run make PY=/path/to/python3.12"'
	@test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/meshtrain train $(ARGS)

# The documentation site, strictly: any warning (a broken link or reference, a docstring
# autodoc cannot read) fails the build. Output in docs/_build/html.
DOCS_BUILD = $(VENV)/bin/python -m sphinx -b html -W --keep-going -q -d docs/_build/doctrees docs docs/_build/html

docs: $(STAMP)
	$(DOCS_BUILD)

# mypy and the docs build run side by side (one core each). The build reads every page afresh
# (-E: an incremental build would not repeat an unchanged page's warning), and
# tests/test_docs.py then checks the site just built (MESHTRAIN_DOCS_SITE), not a second one.
test: $(STAMP)
	$(VENV)/bin/python -m ruff check .
	$(VENV)/bin/python -m mypy & mypy=$$!; $(DOCS_BUILD) -E; docs=$$?; wait $$mypy && exit $$docs
	MESHTRAIN_DOCS_SITE=docs/_build/html $(VENV)/bin/python -m pytest -n 2 --dist loadgroup -q --durations=25 -m "not kit and not lowest" $(ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The lowest versions pyproject.toml allows (jax 0.11.2, the GPU image's), in .venv-lowest:
# the GPU kit's dry run in an image-like venv with the bundle, then a smoke subset.
test-lowest: $(STAMP) gpu-bundle
	PY=$(PY) bash scripts/ci_lowest.sh

# The Scaling out guide's SLURM recipes on a real one-node SLURM: Debian's slurm-wlm and munge
# (installed when absent, which needs root), daemons started and stopped by the script.
test-slurm: $(STAMP)
	bash scripts/ci_slurm.sh

# .whl/: the wheels a GPU machine needs and its image lacks; scripts/gpu_check.sh installs them there.
gpu-bundle: $(STAMP)
	$(VENV)/bin/python scripts/gpu_bundle.py --out .whl

# The PyTorch baseline computes meshtrain's loss and gradient norm on the same weights and
# batch (CPU, float32). Needs Python 3.11 and the CPU torch 2.13.0 wheel; not part of CI.
PY311 ?= $(shell command -v python3.11 2>/dev/null || echo python3.11)
TORCH_VENV := .venv-torch
$(TORCH_VENV)/.installed:
	test -x $(TORCH_VENV)/bin/python || $(PY311) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q torch==2.13.0 numpy
	@touch $@

torch-parity: $(STAMP) $(TORCH_VENV)/.installed
	for style in llama gpt2; do \
	  $(VENV)/bin/python benchmarks/torch_parity.py build/torch_parity_$$style.npz --style $$style && \
	  $(TORCH_VENV)/bin/python benchmarks/baseline_torch.py --parity build/torch_parity_$$style.npz || exit 1; \
	done

lint: $(STAMP)
	$(VENV)/bin/python -m ruff check . && $(VENV)/bin/python -m ruff format --check .

# The type checker over the public modules ([tool.mypy] in pyproject.toml lists them).
typecheck: $(STAMP)
	$(VENV)/bin/python -m mypy

clean:
	rm -rf $(VENV) .venv-lowest $(TORCH_VENV) .whl build *.egg-info .pytest_cache docs/_build
