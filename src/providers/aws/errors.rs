//! What an EC2 failure means for berth: worth retrying, a class to fix, a
//! permission to grant, or a refusal. Pure, so that every code EC2
//! documents for these calls has its row in a table test.

use super::ec2::CallError;
use crate::providers::ProviderError;

/// How a failed call is classed, before it becomes a [`ProviderError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// EC2 asks berth to slow down.
    Throttled,
    /// Capacity, an internal error, a 5xx, no answer: may pass by itself.
    Transient,
    /// The class asks for something EC2 will not do (a bad parameter, an
    /// image or subnet that does not exist).
    InvalidSpec,
    /// An account or subnet limit (vCPUs, instances, volumes, addresses):
    /// not a refusal of the class. It passes when the quota is raised or
    /// other instances go, so it is tried again with backoff, and said.
    Quota,
    /// The credentials are refused or may not make this call.
    Unauthorized,
    /// The instance named does not exist.
    NotFound,
    /// Anything else EC2 refuses.
    Permanent,
}

impl Class {
    /// The `result` label of `berth_provider_requests_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Class::Throttled => "throttled",
            Class::Transient => "transient",
            Class::InvalidSpec => "invalid_spec",
            Class::Quota => "quota",
            Class::Unauthorized => "unauthorized",
            Class::NotFound => "not_found",
            Class::Permanent => "permanent",
        }
    }

    /// Whether the same request may be sent again at once (with backoff).
    pub(crate) fn retryable(self) -> bool {
        matches!(self, Class::Throttled | Class::Transient)
    }
}

pub(crate) fn classify(e: &CallError) -> Class {
    let code = e.code.as_str();
    match code {
        "RequestLimitExceeded" | "Throttling" | "ThrottlingException" | "SlowDown" => {
            Class::Throttled
        }
        "InsufficientInstanceCapacity"
        | "InsufficientCapacity"
        | "InsufficientHostCapacity"
        | "InsufficientReservedInstanceCapacity"
        | "InternalError"
        | "InternalFailure"
        | "ServiceUnavailable"
        | "Unavailable"
        | "RequestExpired"
        | "ExpiredToken"
        | "Transport"
        | "Timeout"
        // IAM is eventually consistent: a profile made a moment ago.
        | "InvalidInstanceProfile.NotFound" => Class::Transient,
        "UnauthorizedOperation"
        | "AuthFailure"
        | "InvalidClientTokenId"
        | "SignatureDoesNotMatch"
        | "OptInRequired"
        | "AccessDenied"
        | "Blocked"
        | "PendingVerification" => Class::Unauthorized,
        "InvalidInstanceID.NotFound" => Class::NotFound,
        "VcpuLimitExceeded"
        | "InstanceLimitExceeded"
        | "MaxSpotInstanceCountExceeded"
        | "VolumeLimitExceeded"
        | "MaxIOPSLimitExceeded"
        | "ResourceLimitExceeded"
        | "AddressLimitExceeded"
        | "NetworkInterfaceLimitExceeded"
        | "InsufficientFreeAddressesInSubnet" => Class::Quota,
        "InvalidParameterValue"
        | "InvalidParameterCombination"
        | "InvalidParameter"
        | "MissingParameter"
        | "UnknownParameter"
        | "Unsupported"
        | "UnsupportedOperation"
        | "VPCIdNotSpecified"
        | "InvalidUserData.Malformed"
        | "InvalidBlockDeviceMapping"
        | "InvalidIAMInstanceProfile.NotFound"
        | "IdempotentParameterMismatch" => Class::InvalidSpec,
        c if c.starts_with("InvalidAMIID.")
            || c.starts_with("InvalidSubnetID.")
            || c.starts_with("InvalidSubnet")
            || c.starts_with("InvalidGroup")
            || c.starts_with("InvalidKeyPair.")
            || c.starts_with("InvalidSecurityGroupID.") =>
        {
            Class::InvalidSpec
        }
        _ => match e.status {
            Some(s) if s >= 500 => Class::Transient,
            Some(429) => Class::Throttled,
            None => Class::Transient,
            _ => Class::Permanent,
        },
    }
}

/// The error berth reports for a failed `action`. An authorisation failure
/// names the IAM permission the call needs, so that the condition says
/// what to grant.
pub(crate) fn provider_error(action: &str, e: &CallError) -> ProviderError {
    let class = classify(e);
    match class {
        Class::Throttled => ProviderError::Transient(format!("EC2 {action} throttled: {e}")),
        Class::Transient => ProviderError::Transient(format!("EC2 {action}: {e}")),
        Class::InvalidSpec => ProviderError::InvalidSpec(format!("EC2 {action} refused: {e}")),
        Class::Quota => ProviderError::Transient(format!(
            "EC2 {action}: a limit of the account or subnet is reached ({e}): raise it or free \
             capacity; tried again with backoff"
        )),
        Class::Unauthorized => ProviderError::Unauthorized(format!(
            "EC2 {action} refused ({}): berth's credentials need the IAM permission ec2:{action}, \
             or are not valid ({})",
            e.code, e.message
        )),
        Class::NotFound => ProviderError::NotFound(format!("EC2 {action}: {e}")),
        Class::Permanent => ProviderError::Permanent(format!("EC2 {action}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(status: Option<u16>, code: &str) -> CallError {
        CallError {
            status,
            code: code.into(),
            message: "m".into(),
        }
    }

    #[test]
    fn every_code_has_its_class() {
        let table = [
            (Some(503), "RequestLimitExceeded", Class::Throttled),
            (Some(400), "Throttling", Class::Throttled),
            (Some(429), "TooManyRequests", Class::Throttled),
            (Some(500), "InsufficientInstanceCapacity", Class::Transient),
            (Some(500), "InternalError", Class::Transient),
            (Some(503), "Unavailable", Class::Transient),
            (Some(502), "HTTP502", Class::Transient),
            (None, "Transport", Class::Transient),
            (None, "Timeout", Class::Transient),
            (Some(400), "ExpiredToken", Class::Transient),
            (Some(403), "UnauthorizedOperation", Class::Unauthorized),
            (Some(401), "AuthFailure", Class::Unauthorized),
            (Some(403), "OptInRequired", Class::Unauthorized),
            (Some(400), "InvalidInstanceID.NotFound", Class::NotFound),
            (Some(400), "InvalidAMIID.NotFound", Class::InvalidSpec),
            (Some(400), "InvalidAMIID.Malformed", Class::InvalidSpec),
            (Some(400), "InvalidSubnetID.NotFound", Class::InvalidSpec),
            (Some(400), "InvalidGroup.NotFound", Class::InvalidSpec),
            (Some(400), "InvalidKeyPair.NotFound", Class::InvalidSpec),
            (Some(400), "InvalidParameterValue", Class::InvalidSpec),
            (Some(400), "InvalidParameterCombination", Class::InvalidSpec),
            (Some(400), "IdempotentParameterMismatch", Class::InvalidSpec),
            (Some(400), "InstanceLimitExceeded", Class::Quota),
            (Some(400), "VcpuLimitExceeded", Class::Quota),
            (Some(400), "VolumeLimitExceeded", Class::Quota),
            (Some(400), "InsufficientFreeAddressesInSubnet", Class::Quota),
            (Some(400), "SomethingNew", Class::Permanent),
        ];
        for (status, code, class) in table {
            assert_eq!(classify(&err(status, code)), class, "{code} ({status:?})");
        }
    }

    #[test]
    fn an_authorisation_failure_names_the_permission() {
        let e = provider_error("RunInstances", &err(Some(403), "UnauthorizedOperation"));
        let ProviderError::Unauthorized(msg) = e else {
            panic!("{e:?}")
        };
        assert!(msg.contains("ec2:RunInstances"), "{msg}");
        assert!(matches!(
            provider_error("RunInstances", &err(Some(503), "RequestLimitExceeded")),
            ProviderError::Transient(_)
        ));
        assert!(matches!(
            provider_error("RunInstances", &err(Some(400), "InvalidAMIID.NotFound")),
            ProviderError::InvalidSpec(_)
        ));
        assert!(matches!(
            provider_error("RunInstances", &err(Some(400), "VcpuLimitExceeded")),
            ProviderError::Transient(m) if m.contains("limit")
        ));
        assert!(Class::Throttled.retryable() && !Class::InvalidSpec.retryable());
    }
}
