# The two commands a user needs: `make demo` and `make test`. Each creates or reuses .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: demo test lint typecheck pytest mutants bench bench-report docs docs-serve notebooks sizes-data clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The demo installs what it runs (the `models` extra), not the whole dev toolchain. On a
# first run that is torch and diffusers, minutes of download: say so, and show pip's progress.
$(VENV)/.installed-models: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "make demo: installing torch (the version constraints.txt pins; the build already in $(VENV), else the one pip picks for this platform) and the models extra (diffusers, rich) into $(VENV); a few minutes on the first run"
	$(PY) -m pip install --progress-bar on --disable-pip-version-check -c constraints.txt -e '.[models]'
	touch $@

demo: $(VENV)/.installed-models
	$(PY) -m sessionstate.cli ab --preset tiny

# Lint, type check, every test (doctests, notebooks and the strict docs build included).
test: lint typecheck pytest

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks docs notebooks tools
	$(PY) -m ruff format --check src tests benchmarks docs/gen_sizes.py docs/gen_tables.py docs/griffe_doctest.py notebooks tools

typecheck: $(STAMP)
	$(PY) -m mypy

# Everything but the Ray tests on two pytest-xdist workers, then the Ray tests alone, beside
# their one local cluster (see tests/conftest.py).
TEST_WORKERS ?= 2

pytest: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not ray" --durations=15
	$(PY) -m pytest -m ray --durations=5

# Plant known bugs in a copy of src/ and check the tests catch each (slow; not part of `test`).
mutants: $(STAMP)
	$(PY) tools/mutants.py

bench: $(STAMP)
	$(PY) benchmarks/run.py --out benchmarks/results/latest.json
	$(PY) benchmarks/chart.py

# The report (and so the performance page's tables) from the committed JSON alone.
bench-report: $(STAMP)
	$(PY) benchmarks/report.py benchmarks/results/latest.json

docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	$(PY) -m mkdocs serve

notebooks: $(STAMP)
	MPLBACKEND=Agg $(PY) notebooks/build.py

sizes-data: $(STAMP)
	$(PY) docs/gen_sizes.py

clean:
	rm -rf $(VENV) build dist site src/*.egg-info
