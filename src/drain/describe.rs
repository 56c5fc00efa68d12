//! A planned volume and its wait in words, as the engine's reports and
//! `berth plan` name them: the `Display` of [`PlannedVolume`] and
//! [`VolumeWait`], apart from how the plan is made (`drain::plan`). How
//! `berth plan` prints a whole plan is the command line's
//! (`crate::cli::print`).

use std::fmt;

use crate::drain::plan::{PlannedVolume, VolumeWait};
use crate::drain::select::{NamespacedName, fmt_key};
use crate::drain::volume::is_inline;
use crate::drain::volume_kind::VolumeKind;

fn list(keys: &[NamespacedName]) -> String {
    keys.iter().map(fmt_key).collect::<Vec<_>>().join(", ")
}

impl fmt::Display for PlannedVolume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if is_inline(&self.volume.pv) {
            write!(f, "{} (in the pod spec", self.volume.pv)?;
        } else {
            write!(
                f,
                "PV {} (claim {}",
                self.volume.pv,
                fmt_key(&self.volume.claim)
            )?;
        }
        if self.volume.ephemeral {
            f.write_str(", ephemeral")?;
        }
        write!(f, "), {}: {}", self.kind, self.kind_why)?;
        match (&self.volume.unique_name, self.kind) {
            (Some(unique), _) => write!(f, "; on the Node as {unique}")?,
            (None, VolumeKind::Attachable) => {
                f.write_str("; no unique name: recognised by VolumeAttachment only")?;
            }
            (None, _) => {}
        }
        if self.attached_to.is_empty() {
            f.write_str(", attached nowhere per VolumeAttachments")
        } else {
            write!(f, ", attached to {}", self.attached_to.join(", "))
        }
    }
}

impl fmt::Display for VolumeWait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Detach {
                gone_first,
                reattach,
            } => {
                f.write_str("last user: waits ")?;
                if !gone_first.is_empty() {
                    write!(
                        f,
                        "until {} {} gone, then ",
                        list(gone_first),
                        if gone_first.len() == 1 { "is" } else { "are" }
                    )?;
                }
                f.write_str("for detach")?;
                if *reattach {
                    f.write_str(", then for attach to another Node")
                } else {
                    f.write_str("; no reattach (ephemeral claim dies with its pod)")
                }
            }
            Self::LeftTo { last_user } => write!(
                f,
                "shared: {} uses it later and waits for it",
                fmt_key(last_user)
            ),
            Self::StaysAttached { pinned_by } => write!(
                f,
                "stays attached: also used by {}, which end(s) with the VM; no detach wait",
                list(pinned_by)
            ),
            Self::ReplacementReady => f.write_str(
                "no detach or attach: waits for the pod that uses the claim next to be Running and Ready on another Node",
            ),
            Self::DiesWithPod => {
                f.write_str("no wait: the ephemeral claim dies with its pod")
            }
            Self::DataLost => f.write_str(
                "its data stays on this Node and is lost with the VM; evicted without any reattach wait",
            ),
        }
    }
}
