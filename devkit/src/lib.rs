//! berth's development kit: everything that is for developing and proving
//! berth and never for running it in a cluster.
//!
//! - [`testbed`]: a local control plane (etcd, kube-apiserver,
//!   kube-controller-manager, kube-scheduler, kwok) built from pinned Go
//!   modules, and the fixtures the tests put into it;
//! - [`bench`](mod@bench): `berth-dev bench`, the drain benchmark;
//! - [`demo`]: `berth-dev demo`, the README's first command;
//! - [`suite`]: `berth-dev suite`, the whole test suite as `make test`
//!   runs it, its test binaries side by side;
//! - [`moto`]: moto's EC2 server, the emulator the cloud side is tested
//!   against, with an EC2 client to seed it, a fault-injecting proxy in
//!   front of it and a joining kubelet that registers its instances as
//!   Nodes.
//!
//! The controller crate (`berth`) does not depend on this one; its tests
//! do, as a dev-dependency.
#![forbid(unsafe_code)]

pub mod bench;
pub mod demo;
pub mod moto;
pub mod suite;
pub mod testbed;
