//! The volume-aware drain: which pods go, in what order, the engine that
//! evicts them and waits for their volumes to move, and the move
//! [`ledger`] that keeps each workload's moves within its budget across
//! every drain.

pub mod cluster_rules;
pub mod deadline;
mod describe;
pub mod engine;
pub mod ledger;
pub mod pdb;
pub mod plan;
pub mod pod_writes;
pub mod resume;
pub mod rules;
pub mod select;
pub mod surge;
pub mod volume;
pub mod volume_kind;

#[cfg(test)]
pub(crate) mod fixtures;
