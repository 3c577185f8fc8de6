# Spillway — the two commands a newcomer needs:
#   make run    start the all-in-one broker (AMQP on 5672, data in ./data)
#   make test   install what the tests need, then run the whole suite
# make images   build the images docker-compose.yml runs (no registry needed)
.PHONY: images run test build deps venv lint test-build test-rust test-python bench fmt clean

CARGO := scripts/cargo.sh

run: deps
	$(CARGO) run --release -p spillway --

deps:
	@scripts/install-deps.sh

venv:
	@scripts/python-venv.sh

build: deps
	$(CARGO) build --release -p spillway -p spillway-loadgen -p spillway-ctl

lint: deps
	cargo fmt --all -- --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings

# Building every target at once (tests included) gives one feature set, so
# `cargo test` then reuses it instead of recompiling half the tree.
test-build: deps
	$(CARGO) build --release --workspace --all-targets

test-rust: test-build
	$(CARGO) test --release --workspace

test-python: test-build venv
	.venv/bin/pytest tests/python -q -p no:cacheprovider

test: lint test-rust test-python

bench: deps
	@scripts/install-deps.sh --bench
	scripts/bench.sh

images: deps
	$(CARGO) build --release -p spillway -p spillway-loadgen
	rm -rf deploy/context && mkdir -p deploy/context
	cp target/release/spillway target/release/spillway-loadgen deploy/context/
	deploy/make-base.sh
	docker build -q -t spillway:local -f deploy/Dockerfile deploy/context

fmt:
	cargo fmt --all

clean:
	cargo clean
	rm -rf .venv
