# Two commands are all the set-up there is: `make train` and `make test`.
# Both create (or reuse) .venv from Python 3.12 and install the project into it.
PYENV_PY := $(shell pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12
PY ?= $(shell command -v python3.12 2>/dev/null || (test -x $(PYENV_PY) && echo $(PYENV_PY)) || echo python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: train test lint venv clean

$(STAMP): pyproject.toml
	@$(PY) -c 'import sys; assert sys.version_info >= (3, 12), f"meshtrain needs Python >= 3.12, got {sys.version.split()[0]} from $(PY); install 3.12 (pyenv install 3.12) or run make PY=/path/to/python3.12"'
	@test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/meshtrain train $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m ruff check .
	$(VENV)/bin/python -m pytest -n 2 --dist loadgroup -q $(ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/python -m ruff check . && $(VENV)/bin/python -m ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
