# Self-documenting Makefile: `make help` lists the targets with their `##` comments.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
EXT_STAMP := $(VENV)/.ext-built
RUST_SRC := $(shell find rust -name '*.rs' -o -name Cargo.toml 2>/dev/null) Cargo.toml

.DEFAULT_GOAL := help
.PHONY: help install build-dev format lint typecheck test test-rust test-python miri bench bench-compare demo wheel clean

help: ## show this help
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# dependencies come from pyproject.toml; the package itself is installed by `maturin develop`
	$(PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	  print('\n'.join(p['dependencies'] + p['optional-dependencies']['dev']))" > $(VENV)/requirements.txt
	$(PIP) install -q -r $(VENV)/requirements.txt
	touch $(STAMP)

install: $(STAMP) ## create the venv and install the package with its dev dependencies

# The release core, always: what `make test`, `make demo`, `make bench` and `gateway serve` run
# is what was measured (a debug core is ~3x slower per scheduling call).
$(EXT_STAMP): $(STAMP) $(RUST_SRC)
	$(VENV)/bin/maturin develop -q --release
	touch $(EXT_STAMP)

build-dev: $(EXT_STAMP) ## build the Rust extension (release) into the venv

format: $(STAMP) ## format Rust and Python sources
	cargo fmt --all
	$(VENV)/bin/ruff format python tests benches
	$(VENV)/bin/ruff check --fix python tests benches

lint: $(STAMP) ## rustfmt --check, clippy -D warnings, ruff check, ruff format --check
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches

typecheck: build-dev ## mypy --strict and stubtest of the extension's stub
	$(VENV)/bin/mypy --strict python/gateway
	$(VENV)/bin/python -m mypy.stubtest gateway._core

test-rust: ## cargo test of the pure core (never links libpython), and its loom models
	cargo test --workspace --exclude gateway-py
	@# SPEC §12: every interleaving of the shared region's protocols, a worker killed at each step
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p gateway-core --test loom_shm --release

miri: ## Miri over the workers' shared region (needs `rustup +nightly component add miri rust-src`)
	MIRIFLAGS=-Zmiri-ignore-leaks CARGO_TARGET_DIR=target/miri cargo +nightly miri test -p gateway-core --lib shm
	MIRIFLAGS=-Zmiri-ignore-leaks CARGO_TARGET_DIR=target/miri cargo +nightly miri test -p gateway-core --test region_cast --test shared -- --skip random

test-python: build-dev ## pytest: unit, integration over loopback, the official openai client
	@# pytest exits 5 when it collects no test: that is not a failure of the code under test
	$(VENV)/bin/pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test: lint test-rust typecheck test-python ## everything: lint, cargo test, mypy, stubtest, pytest

bench: build-dev ## pytest-benchmark of the core, saved as a baseline (see benches/README.md)
	$(VENV)/bin/pytest benches --benchmark-only --benchmark-autosave -q

bench-compare: build-dev ## rerun the benchmarks and fail on a mean regression over 10 %
	$(VENV)/bin/pytest benches --benchmark-only -q --benchmark-compare --benchmark-compare-fail=mean:10%

wheel: $(STAMP) ## build a release wheel into dist/
	$(VENV)/bin/maturin build --release -o dist

demo: build-dev ## run the embedded demo: simulated pools, a judge workload, an injected crash
	$(VENV)/bin/gateway demo

clean: ## remove build outputs and the venv
	rm -rf target dist $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks
	find python -name '*.so' -delete
