//! Process wiring: how the watches, the controllers, leader election,
//! telemetry and shutdown are put together. `process` is `berth run`;
//! `manager` starts the controllers on the caches `watches` fills;
//! `leader` is the election, `fence` keeps every write in the process
//! behind leadership, and `ratelimit` is the client's token bucket.

pub mod fence;
pub mod leader;
pub mod manager;
pub mod process;
pub(crate) mod ratelimit;
pub(crate) mod watches;
