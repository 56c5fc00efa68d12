//! berth: a Kubernetes controller that owns the lifecycle of Machines and
//! drains their Nodes in a volume-aware order.
#![forbid(unsafe_code)]

pub mod api;
pub mod cache;
pub mod cli;
pub mod controller;
pub mod drain;
pub mod drainrule;
pub mod machine;
pub mod machinedeployment;
pub mod machineset;
pub mod orphans;
pub mod placement;
pub mod providers;
pub mod telemetry;
pub mod volumes;
pub mod wiring;
