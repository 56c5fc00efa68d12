# The two commands of the README. Everything they need is built here or by
# hack/testbed/build.sh (cached outside the repository).
.PHONY: demo test testbed lint

## demo: the main job: a local control plane, the controller, and a Machine deletion with a volume-aware drain, live
demo:
	BERTH_TESTBED_BIN="$$(bash hack/testbed/build.sh --bin-dir)" cargo run --locked --quiet -- demo

## test: build or reuse the test control plane, check format and lints, run every test
test: testbed lint
	BERTH_TESTBED_BIN="$$(bash hack/testbed/build.sh --bin-dir)" cargo test --locked

## testbed: build (cold: ~13 min on 2 cores) or reuse (warm: instant) the control plane binaries
testbed:
	bash hack/testbed/build.sh

lint:
	cargo fmt --check
	cargo clippy --locked --all-targets -- -D warnings
