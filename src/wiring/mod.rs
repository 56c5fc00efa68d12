//! Process wiring: how the controller, leader election, telemetry and
//! shutdown are put together.

pub mod fence;
pub mod leader;
pub mod process;
pub(crate) mod ratelimit;
