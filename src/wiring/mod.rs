//! Process wiring: how the watches, the controllers, leader election,
//! telemetry and shutdown are put together. `process` is `berth run`;
//! `manager` starts the controllers on the caches `watches` fills.

pub mod fence;
pub mod leader;
pub mod manager;
pub mod process;
pub(crate) mod ratelimit;
pub(crate) mod watches;
