# syntax=docker/dockerfile:1
# berth's container image: a release build with the locked dependencies,
# copied onto distroless (glibc and CA certificates, no shell, no package
# manager), running as the numeric non-root user 65532.
#
#   docker build -t berth .
#
# The build command is the same as `make release`; tests/chart.rs checks that
# they never drift apart.

FROM rust:1.95-bookworm AS builder
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
# The workspace's second member (the development kit): Cargo reads its
# manifest; the build below compiles none of it.
COPY devkit/Cargo.toml ./devkit/Cargo.toml
COPY devkit/src ./devkit/src
RUN cargo build --release --locked

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /src/target/release/berth /berth
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/berth"]
CMD ["run"]
