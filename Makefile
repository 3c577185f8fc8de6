# Spillway — the two commands a newcomer needs:
#   make run    start the all-in-one broker (AMQP on 5672, data in ./data)
#   make test   install what the tests need, then run the whole suite
# make images   build the images docker-compose.yml runs (no registry needed)
# make compose-test     the compose stack with its `test` profile (load, flow to disk, capacity)
# make compose-faults   kill storage, engine, gateways and cut engine<->storage under traffic
# make sim SEEDS=N      the storage group's deterministic simulation (SEED=S replays one)
.PHONY: images run test test-stages build deps test-deps venv lint test-build test-rust test-python bench bench-delayed fmt clean \
	test-fuzz fuzz sim \
	bench-flow-to-disk bench-console bench-admin-polling \
	docker-check images-from-build compose-test compose-faults

CARGO := scripts/cargo.sh
# Each stage of `make test` prints its wall time; the summary comes at the end.
TIMED := scripts/timed.sh

# The same build as `make test` (every target at once, one feature set):
# after one, the other compiles nothing. `cargo run -p spillway` alone would
# resolve features without the tests' dependencies and rebuild half the tree.
run: deps
	$(CARGO) build --release --workspace --all-targets
	./target/release/spillway

deps:
	@$(TIMED) deps scripts/install-deps.sh

venv:
	@$(TIMED) venv scripts/python-venv.sh

build: deps
	$(CARGO) build --release -p spillway -p spillway-loadgen -p spillway-ctl

# Clippy runs after the build: it then reuses the build's dependencies
# (RocksDB's C++ included) instead of being the one that compiles them.
lint: deps test-build
	$(TIMED) fmt cargo fmt --all -- --check
	$(TIMED) clippy $(CARGO) clippy --release --workspace --all-targets -- -D warnings

# Building every target at once (tests included) gives one feature set, so
# `cargo test` then reuses it instead of recompiling half the tree.
test-build: deps
	$(TIMED) build $(CARGO) build --release --workspace --all-targets

test-rust: test-build
	$(TIMED) rust-tests $(CARGO) test --release --workspace

# Coverage-guided fuzzing of the parsers of client input, 25 s per target
# (docs/fuzzing.md); `make fuzz` runs longer (FUZZ_SECONDS per target, 600 by default).
test-fuzz: deps
	$(TIMED) fuzz scripts/fuzz.sh

fuzz: deps
	FUZZ_SECONDS=$${FUZZ_SECONDS:-600} scripts/fuzz.sh

# The storage group's deterministic simulation (docs/replication.md): SEEDS
# seeds from FIRST (1000 from 1 by default), or SEED=S alone to replay one.
# `make test` runs 400 of them (crates/spillway-sim/tests/seeds.rs).
SEEDS ?= 1000
FIRST ?= 1
sim: deps
	$(CARGO) build --release --workspace --all-targets
	./target/release/spillway-sim $(if $(SEED),--seed $(SEED),--seeds $(SEEDS) --first $(FIRST))

# The console's browser tests need Debian's chromium and chromium-driver.
test-deps:
	@$(TIMED) test-deps scripts/install-deps.sh --test

test-python: test-build venv test-deps
	$(TIMED) python-tests .venv/bin/pytest tests/python -q -p no:cacheprovider

# The stages run in this order; a failed stage stops the run, and the times of
# the stages that ran are printed either way.
test:
	@$(TIMED) --reset
	@$(MAKE) --no-print-directory test-stages; rc=$$?; $(TIMED) --summary; exit $$rc

test-stages: lint test-rust test-fuzz test-python compose-test compose-faults

# Cases a-i for Spillway (both wirings) and RabbitMQ in one run, d (the 2 GiB
# backlog) through scripts/bench-flow-to-disk.sh. BENCH_TARGETS / BENCH_SCENARIOS: see the script.
bench: deps
	@scripts/install-deps.sh --bench
	scripts/bench.sh
	$(MAKE) --no-print-directory bench-console

# The web console with 10,000 queues in headless Chromium: how long the overview and the
# queues page take to show (BENCH_CONSOLE_QUEUES / BENCH_CONSOLE_ROUNDS: see the script).
# Uses the broker the last build made (target/release/spillway, or SPILLWAY_BIN).
bench-console: deps venv test-deps
	.venv/bin/python scripts/bench-console.py

# 100,000 queues, 8 clients polling GET /api/queues/%2F/<one queue> in a loop, and a bystander
# publishing with confirms: its p50/p99, the polls/s, the broker's peak RSS (BENCH_ADMIN_*: see
# the script). Uses the broker the last build made (target/release/spillway, or SPILLWAY_BIN).
bench-admin-polling: deps venv test-deps
	.venv/bin/python scripts/bench-admin-polling.py

# Backlogs of 2 GiB (1 KiB and 64 KiB messages) built with no consumer, then drained: Spillway
# spilling past a 256 MiB threshold, Spillway all in memory, RabbitMQ with a 256 MiB watermark.
# BENCH_FTD_BYTES / BENCH_FTD_SIZES / BENCH_FTD_TARGETS / BENCH_FTD_THRESHOLD: see the script.
bench-flow-to-disk: deps
	@scripts/install-deps.sh --bench
	scripts/bench-flow-to-disk.sh

# Delayed messages: 10 million of 100 bytes due over 10 minutes through an x-delayed-message
# exchange; lateness p50/p99, peak RSS against the budget. BENCH_DELAYED_*: see the script.
bench-delayed: deps
	@scripts/install-deps.sh --bench
	scripts/bench-delayed.sh

images: deps docker-check
	$(CARGO) build --release -p spillway -p spillway-loadgen
	deploy/make-images.sh

# Fails with a clear message where Docker (daemon and Compose) is not usable.
docker-check:
	@scripts/compose-check.sh

# The compose tests put the binaries `test-build` already made into the images
# (no second build with another feature set).
images-from-build: test-build docker-check
	$(TIMED) images deploy/make-images.sh

compose-test: images-from-build
	$(TIMED) compose-test scripts/compose-test.sh

compose-faults: images-from-build
	$(TIMED) compose-faults scripts/compose-faults.sh

fmt:
	cargo fmt --all

clean:
	cargo clean
	rm -rf .venv
