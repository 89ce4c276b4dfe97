# Self-documenting Makefile: `make help` lists the targets with their `##` comments.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
EXT_STAMP := $(VENV)/.ext-built
RUST_SRC := $(shell find rust -name '*.rs' -o -name Cargo.toml 2>/dev/null) Cargo.toml

.DEFAULT_GOAL := help
.PHONY: help install build-dev format lint typecheck test test-rust test-python test-slow miri bench bench-compare demo wheel wheel-aarch64 sdist dist-check clean

help: ## show this help
	@grep -E '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'

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

# Two pytest processes (pytest-xdist), each taking whole files (module-scoped set-ups stay
# shared): most tests wait on real servers and timers, so two fit 2 cores. TEST_JOBS=0 runs
# one process.
TEST_JOBS ?= 2
test-python: build-dev ## pytest: unit, integration over loopback, the official openai client
	@# pytest exits 5 when it collects no test: that is not a failure of the code under test
	$(VENV)/bin/pytest -q -n $(TEST_JOBS) --dist loadfile tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test: lint test-rust typecheck test-python ## everything: lint, cargo test, mypy, stubtest, pytest

test-slow: build-dev ## the long real-time soaks (pytest -m slow: kill -9 of workers every second for 30 s)
	$(VENV)/bin/pytest -q -m slow tests

bench: build-dev ## pytest-benchmark of the core, saved as a baseline (see benches/README.md)
	$(VENV)/bin/pytest benches --benchmark-only --benchmark-autosave -q

# A regression run against a git ref built side by side (benches/compare.py): BASE in a worktree
# under target/bench-base, base and working tree run alternately in one session (core
# micro-benchmarks and the end-to-end CPU per request), failing beyond TOLERANCE.
BASE ?= main
TOLERANCE ?= 0.10
ROUNDS ?= 3
bench-compare: build-dev ## benchmarks of BASE (default main) and of the working tree side by side; fails on a regression over TOLERANCE (0.10)
	$(VENV)/bin/python benches/compare.py --base $(BASE) --tolerance $(TOLERANCE) --rounds $(ROUNDS)

# SPEC §18: wheels that pip installs on the machines users run. manylinux2014 is glibc 2.17, below
# every supported Linux (RHEL/Rocky/Alma 8: 2.28, Amazon Linux 2: 2.26, Debian 11 and Ubuntu
# 20.04: 2.31); a wheel built against this host's glibc would be refused on all of them. zig
# (PyPI's ziglang, a dev dependency) links against glibc 2.17 whatever the host has and
# cross-compiles aarch64; PyPA's auditwheel then reports the tag the symbols allow, and the
# target fails unless it is the expected one. The wheel builds in target/wheel so it never
# invalidates the dev extension's build in target/release.
MANYLINUX := manylinux2014
MANYLINUX_TAG := manylinux_2_17
WHEEL_ENV := CARGO_TARGET_DIR=target/wheel CARGO_ZIGBUILD_PYTHON_PATH=$(abspath $(PY))
DIST_CHECK := target/dist-check

# $(call manylinux_wheel,ARCH): the wheel for ARCH-unknown-linux-gnu into dist/, its tag checked.
define manylinux_wheel
	@mkdir -p dist && rm -f dist/gateway-*-linux_$(1).whl dist/gateway-*manylinux*_$(1).whl
	@if command -v rustup >/dev/null; then rustup target add $(1)-unknown-linux-gnu >/dev/null; fi
	$(WHEEL_ENV) $(VENV)/bin/maturin build --release --locked --zig --compatibility $(MANYLINUX) \
	  --target $(1)-unknown-linux-gnu -o dist
	@whl=$$(ls dist/gateway-*.$(MANYLINUX_TAG)_$(1).whl) && shown=$$($(VENV)/bin/auditwheel show "$$whl") \
	  && echo "$$shown" && grep -q '"$(MANYLINUX_TAG)_$(1)"' <<<"$$shown" \
	  || { echo "auditwheel: $$whl is not $(MANYLINUX_TAG)_$(1)" >&2; exit 1; }
endef

wheel: $(STAMP) ## build the manylinux2014 (glibc 2.17) x86_64 wheel into dist/, its tag checked
	$(call manylinux_wheel,x86_64)

wheel-aarch64: $(STAMP) ## cross-build the manylinux2014 aarch64 wheel into dist/ with zig
	$(call manylinux_wheel,aarch64)

# The sdist builds wherever Rust is installed: pip runs maturin, which runs cargo over the whole
# workspace, so every tracked file of it must be in the archive (and no built extension).
sdist: $(STAMP) ## build the sdist into dist/ and check it holds the whole workspace
	@mkdir -p dist && rm -f dist/gateway-*.tar.gz
	$(VENV)/bin/maturin sdist -o dist
	@listing=$$(tar tzf dist/gateway-*.tar.gz | sed 's|^[^/]*/||'); \
	tracked=$$(git ls-files Cargo.toml Cargo.lock pyproject.toml README.md 'LICENSE*' rust python); \
	[ -n "$$tracked" ] || { echo "the sdist check lists the workspace with git" >&2; exit 1; }; \
	for f in $$tracked; do \
	  grep -qxF "$$f" <<<"$$listing" || { echo "sdist lacks $$f" >&2; exit 1; }; \
	done; \
	if grep -E '\.(so|pyd)$$' <<<"$$listing"; then echo "sdist holds a built extension" >&2; exit 1; fi; \
	echo "sdist ok: $$(ls dist/gateway-*.tar.gz), $$(wc -l <<<"$$listing") files"

# Each artifact into a clean venv of the system's python3, away from the source tree: the wheel,
# the sdist compiled from source by pip (no cache, so it really builds).
# Between them, pip resolves the wheel's dependencies as a manylinux2014 host would: a binary
# wheel for each, or the target fails (the host would need a compiler).
dist-check: wheel sdist ## install the wheel and the sdist into clean venvs and run `gateway check`
	rm -rf $(DIST_CHECK) && mkdir -p $(DIST_CHECK)
	printf '%s\n' 'pools:' '  light:' '    instances:' \
	  '      - {name: a, url: "http://127.0.0.1:9001/v1", model: m, max_concurrency: 4}' \
	  'models:' '  judge: {pool: light}' > $(DIST_CHECK)/gateway.yaml
	python3 -m venv $(DIST_CHECK)/wheel
	$(DIST_CHECK)/wheel/bin/pip install -q "$$(ls $(CURDIR)/dist/gateway-*.$(MANYLINUX_TAG)_x86_64.whl)"
	cd $(DIST_CHECK) && wheel/bin/python -c 'import gateway._core as c, gateway.errors, gateway.telemetry; \
	  p = c.Pool(c.PoolConfig()); p.add_instance(1); assert p.submit(1, c.Priority.HIGH, 0) == 0; \
	  assert c.PoolConfig().high_weight == 7; \
	  assert "/dist-check/wheel/" in c.__file__, c.__file__; print("wheel ok:", c.__file__)'
	cd $(DIST_CHECK) && wheel/bin/gateway check gateway.yaml >/dev/null
	@# a glibc 2.17 host installs every dependency from wheels too
	$(VENV)/bin/pip download -q -d $(DIST_CHECK)/manylinux2014 --only-binary=:all: \
	  --platform $(MANYLINUX)_x86_64 --python-version 3.11 --implementation cp \
	  "$$(ls $(CURDIR)/dist/gateway-*.$(MANYLINUX_TAG)_x86_64.whl)"
	python3 -m venv $(DIST_CHECK)/sdist
	time $(DIST_CHECK)/sdist/bin/pip install -q --no-cache-dir $(CURDIR)/dist/gateway-*.tar.gz
	cd $(DIST_CHECK) && sdist/bin/gateway check gateway.yaml >/dev/null
	@echo "sdist ok: built and installed in a clean venv"

demo: build-dev ## run the embedded demo: simulated pools, a judge workload, an injected crash
	$(VENV)/bin/gateway demo

clean: ## remove build outputs and the venv
	rm -rf target dist $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks
	find python -name '*.so' -delete
