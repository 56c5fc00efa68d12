# The two commands of the README. Everything they need is built here or by
# hack/testbed/build.sh (cached outside the repository).
.PHONY: demo test testbed lint

## demo: the main job: a local control plane, the controller, and a Machine deletion with a volume-aware drain, live
demo:
	BERTH_TESTBED_BIN="$$(bash hack/testbed/build.sh --bin-dir)" cargo run --locked --quiet -- demo

## test: build or reuse the test control plane, check format and lints, run every test
test: testbed lint
	BERTH_TESTBED_BIN="$$(bash hack/testbed/build.sh --bin-dir)" cargo test --locked
	# The Dockerfile's build, without Docker: the release binary, built as its builder stage builds it.
	cargo test --locked --test chart -- --ignored make_release_builds_a_working_binary

## testbed: build (cold: ~13 min on 2 cores) or reuse (warm: instant) the control plane binaries
testbed:
	bash hack/testbed/build.sh

lint:
	cargo fmt --check
	cargo clippy --locked --all-targets -- -D warnings

.PHONY: release manifests

## release: the release binary (target/release/berth), built exactly as the Dockerfile's builder stage builds it
release:
	cargo build --release --locked

## manifests: regenerate the committed CRDs, the chart's CRD template and deploy/berth.yaml from the code and the chart
manifests:
	BERTH_BLESS=1 BERTH_TESTBED_BIN="$$(bash hack/testbed/build.sh --bin-dir)" cargo test --locked --test crd --test chart committed
