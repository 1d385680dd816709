# Two commands do the set-up: `make lab` opens the course, `make test` runs every test.
# Both create .venv on first use and reinstall only when pyproject.toml or
# constraints.txt change, so a second run starts in seconds.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST := $(PY) -m pytest -q -rs
# A root shell (containers, CI) needs JupyterLab's --allow-root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test lint unit notebooks exercises outputs check-exercises slides lock clean gpu-check

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 is pinned in constraints.txt: the CPU build here, never the CUDA wheels.
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(ROOT_FLAG) --ServerApp.root_dir=. notebooks/00_setup.ipynb

test: $(STAMP) lint unit notebooks

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The 20 slowest tests are listed at the end: where the suite's minutes go.
unit: $(STAMP)
	$(PYTEST) --durations=20 tests

# Lectures and solutions: deterministic outputs compared against the committed ones.
# Exercises: run (lax), since they are committed without outputs.
# One torch thread per kernel: two notebooks run at once (-n 2) on a 2-core machine, and two
# threads each made them an order of magnitude slower through oversubscription.
notebooks: export OMP_NUM_THREADS = 1
notebooks: $(STAMP)
	$(PYTEST) -n 2 --dist loadscope --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg notebooks solutions
	$(PYTEST) -n 2 --dist loadscope --nbval-lax --nbval-current-env exercises

exercises: $(STAMP)
	$(PY) -m course_tools.authoring --course . exercises $(if $(FORCE),--force,)

check-exercises: $(STAMP)
	$(PY) -m course_tools.authoring --course . check

outputs: $(STAMP)
	$(PY) -m course_tools.authoring --course . outputs $(NB)

# On a CUDA machine: every lecture and solution, the `gpu` tests and the benchmarks on the GPU,
# reported in benchmarks/results/gpu_check.json (PART=notebooks|tests|benchmarks for one part).
# Uses .venv when there is one, else the machine's python3 (see the README's GPU section).
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
PART   ?= all
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py --part $(PART)

# Reveal.js slides of every lecture in build/slides/ (one slide per ## section).
slides: $(STAMP)
	$(VENV)/bin/jupyter nbconvert --to slides --output-dir build/slides notebooks/*.ipynb

lock: $(STAMP)
	$(PY) -m pip freeze --exclude-editable | sed 's/+cpu$$//' > constraints.txt.new
	{ echo "# Exact versions for the course's own install (make lab / make test / CI)."; \
	  echo "# Regenerate with: make lock"; cat constraints.txt.new; } > constraints.txt
	rm constraints.txt.new

clean:
	rm -rf $(VENV)
