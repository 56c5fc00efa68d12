# The two commands of the README. Everything they need is built here or by
# hack/testbed/build.sh (cached outside the repository).
#
# The workspace has two crates: `berth` (this folder: the controller, the
# only thing the image carries) and `devkit/` (`berth-dev`: the test bed,
# the benchmark, the demo and the test fixtures).
.PHONY: demo test testbed lint deny

## demo: the main job: a local control plane, the controller, and a Machine deletion with a volume-aware drain, live
demo:
	BERTH_TESTBED_BIN="$$(bash hack/testbed/build.sh --bin-dir)" cargo run --locked --quiet -p berth-devkit --bin berth-dev -- demo

## test: build or reuse the test control plane, check format and lints, run every test of both crates
test: testbed lint deny
	mkdir -p target/suite
	cargo test --locked --workspace --no-run --message-format=json-render-diagnostics > target/suite/artifacts.json
	cargo test --locked --workspace --doc
	# The test binaries side by side (docs/testing.md), and beside them, at a
	# low priority, the Dockerfile's build without Docker: the release
	# binary, built as its builder stage builds it, then run.
	BERTH_TESTBED_BIN="$$(bash hack/testbed/build.sh --bin-dir)" BERTH_MOTO_BIN="$$(bash hack/moto/install.sh --bin-dir)" \
		target/debug/berth-dev suite \
		--artifacts target/suite/artifacts.json \
		--extra "release=berth::chart --ignored --exact make_release_builds_a_working_binary"

## testbed: build (cold: ~13 min on 2 cores) or reuse (warm: instant) the control plane binaries
testbed:
	bash hack/testbed/build.sh

lint:
	cargo fmt --all --check
	cargo clippy --locked --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --locked --workspace --no-deps --quiet

## deny: cargo-deny (pinned, cached outside the repository): licences, bans and sources always; advisories against the RustSec database, fetched where it can be, else a local copy, else said loudly
deny:
	deny="$$(bash hack/tools/cargo-deny.sh)" && "$$deny" deny --locked check --hide-inclusion-graph licenses bans sources
	@deny="$$(bash hack/tools/cargo-deny.sh)"; \
	dbs="$${CARGO_HOME:-$$HOME/.cargo}/advisory-dbs"; \
	if timeout 120 "$$deny" deny fetch db >/dev/null 2>&1; then \
		"$$deny" deny --locked --offline check advisories; \
	elif ls -d "$$dbs"/advisory-db-*/.git >/dev/null 2>&1; then \
		echo "deny: the RustSec database cannot be fetched from here; checking the local copy in $$dbs (newest advisory commit: $$(git -C "$$(ls -d "$$dbs"/advisory-db-* | head -n 1)" log -1 --format=%cs))"; \
		"$$deny" deny --locked --offline check advisories; \
	else \
		echo "deny: advisories NOT CHECKED: the RustSec database (a git repository on GitHub) cannot be fetched from this machine and there is no local copy in $$dbs"; \
	fi

.PHONY: release manifests bench

## release: the release binary (target/release/berth), built exactly as the Dockerfile's builder stage builds it
release:
	cargo build --release --locked

## bench: the benchmark (release builds of berth-dev and of the berth it runs as a process); BENCH_ARGS=... passes flags
bench:
	cargo build --release --locked --workspace --bins
	BERTH_TESTBED_BIN="$$(bash hack/testbed/build.sh --bin-dir)" target/release/berth-dev bench $(BENCH_ARGS)

## manifests: regenerate the committed CRDs, the chart's CRD template and deploy/berth.yaml from the code and the chart
manifests:
	# The CRDs first: deploy/berth.yaml is rendered from the chart's CRD template.
	BERTH_BLESS=1 cargo test --locked --test crd committed
	BERTH_BLESS=1 BERTH_TESTBED_BIN="$$(bash hack/testbed/build.sh --bin-dir)" cargo test --locked --test chart committed
