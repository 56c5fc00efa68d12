//! The tags berth puts on every instance and volume it creates: how it
//! finds a Machine's instance after a crash, and how it tells this
//! cluster's instances from everything else in the account.

/// The prefix of berth's own tags; a class may not set tags under it.
pub(crate) const PREFIX: &str = "berth.dev/";
/// The cluster that owns the instance (`berth run --cluster-id`). Orphan
/// collection never touches an instance without it.
pub(crate) const CLUSTER: &str = "berth.dev/cluster";
/// The UID of the Machine the instance was created for: the key of
/// adoption after a crash between `RunInstances` and the status write.
pub(crate) const MACHINE_UID: &str = "berth.dev/machine-uid";
pub(crate) const MACHINE_NAMESPACE: &str = "berth.dev/machine-namespace";
pub(crate) const MACHINE_NAME: &str = "berth.dev/machine-name";
/// The name the EC2 console shows.
pub(crate) const NAME: &str = "Name";

/// Every tag berth sets itself.
pub(crate) const OWN: &[&str] = &[CLUSTER, MACHINE_UID, MACHINE_NAMESPACE, MACHINE_NAME, NAME];
