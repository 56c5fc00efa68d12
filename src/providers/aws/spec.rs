//! The `providerSpec` of an `aws` MachineClass, and the checks it must pass
//! before anything is sent to EC2. Everything here is pure: a class that
//! fails is reported on its Machines as `InvalidProviderSpec`, with the
//! field and the reason, and never reaches the cloud.
//!
//! ```yaml
//! providerSpec:
//!   region: eu-west-1
//!   imageId: ami-0123456789abcdef0
//!   instanceType: m6i.large
//!   subnetId: subnet-0123456789abcdef0
//!   securityGroupIds: [sg-0123456789abcdef0]
//!   iamInstanceProfile: berth-nodes        # a name, or an instance-profile ARN
//!   keyName: ops
//!   tags: {team: storage}
//!   userData: |                            # {{machine}} becomes the Machine's name
//!     #!/bin/sh
//!     hostnamectl set-hostname {{machine}}
//!   rootVolume: {sizeGiB: 50, type: gp3}
//!   instanceMetadata: {httpTokens: required, hopLimit: 1}   # the default
//! ```

use std::collections::BTreeMap;

use serde::Deserialize;

use super::tags;

/// Where the Machine's name is put into `userData`.
pub(crate) const MACHINE_PLACEHOLDER: &str = "{{machine}}";

/// EC2 takes at most 50 tags on a resource; berth puts its own on every
/// instance and volume.
const MAX_TAGS: usize = 50;
/// EC2's limit on user data, before base64.
const MAX_USER_DATA: usize = 16 * 1024;

/// The volume types EC2 offers for a root volume.
const VOLUME_TYPES: &[&str] = &["gp2", "gp3", "io1", "io2", "st1", "sc1", "standard"];

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Raw {
    region: String,
    image_id: String,
    instance_type: String,
    #[serde(default)]
    subnet_id: Option<String>,
    #[serde(default)]
    security_group_ids: Vec<String>,
    #[serde(default)]
    iam_instance_profile: Option<String>,
    #[serde(default)]
    key_name: Option<String>,
    #[serde(default)]
    tags: BTreeMap<String, String>,
    #[serde(default)]
    user_data: Option<String>,
    #[serde(default)]
    root_volume: Option<RawVolume>,
    #[serde(default)]
    instance_metadata: Option<RawMetadata>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawMetadata {
    #[serde(default)]
    http_tokens: Option<String>,
    #[serde(default)]
    hop_limit: Option<u32>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawVolume {
    #[serde(rename = "sizeGiB")]
    size_gib: u32,
    #[serde(default, rename = "type")]
    volume_type: Option<String>,
}

/// An instance profile, as `RunInstances` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum InstanceProfile {
    Name(String),
    Arn(String),
}

/// The root volume's size and type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RootVolume {
    pub size_gib: u32,
    pub volume_type: Option<String>,
}

/// How the instance's metadata service answers: by default IMDSv2 only
/// (`httpTokens: required`) with a hop limit of 1, so that a pod that is
/// not on the host network cannot read the node's role credentials. A
/// class that needs more says so (`instanceMetadata: {httpTokens:
/// optional, hopLimit: 2}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InstanceMetadata {
    pub tokens_required: bool,
    pub hop_limit: u32,
}

impl Default for InstanceMetadata {
    fn default() -> Self {
        Self {
            tokens_required: true,
            hop_limit: 1,
        }
    }
}

/// A checked `providerSpec`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AwsSpec {
    pub region: String,
    pub image_id: String,
    pub instance_type: String,
    pub subnet_id: Option<String>,
    pub security_group_ids: Vec<String>,
    pub iam_instance_profile: Option<InstanceProfile>,
    pub key_name: Option<String>,
    pub tags: BTreeMap<String, String>,
    pub user_data: Option<String>,
    pub root_volume: Option<RootVolume>,
    pub instance_metadata: InstanceMetadata,
}

/// Why a `providerSpec` cannot be used: the field and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub(crate) struct SpecError {
    pub field: String,
    pub reason: String,
}

fn bad(field: impl Into<String>, reason: impl Into<String>) -> SpecError {
    SpecError {
        field: field.into(),
        reason: reason.into(),
    }
}

impl AwsSpec {
    pub(crate) fn parse(v: &serde_json::Value) -> Result<Self, SpecError> {
        if v.is_null() {
            return Err(bad(
                "providerSpec",
                "the aws provider needs region, imageId and instanceType",
            ));
        }
        let raw: Raw =
            serde_json::from_value(v.clone()).map_err(|e| bad("providerSpec", e.to_string()))?;
        check_region(&raw.region)?;
        check_id("imageId", &raw.image_id, "ami-")?;
        check_instance_type(&raw.instance_type)?;
        if let Some(s) = &raw.subnet_id {
            check_id("subnetId", s, "subnet-")?;
        }
        for (i, sg) in raw.security_group_ids.iter().enumerate() {
            check_id(&format!("securityGroupIds[{i}]"), sg, "sg-")?;
        }
        let iam_instance_profile = raw
            .iam_instance_profile
            .as_deref()
            .map(instance_profile)
            .transpose()?;
        if let Some(k) = &raw.key_name
            && (k.is_empty() || k.len() > 255)
        {
            return Err(bad("keyName", "must be 1 to 255 characters"));
        }
        check_tags(&raw.tags)?;
        if let Some(u) = &raw.user_data
            && u.len() > MAX_USER_DATA
        {
            return Err(bad(
                "userData",
                format!("{} bytes; EC2 takes at most {MAX_USER_DATA}", u.len()),
            ));
        }
        let root_volume = raw.root_volume.map(check_volume).transpose()?;
        let instance_metadata = raw
            .instance_metadata
            .map(check_metadata)
            .transpose()?
            .unwrap_or_default();
        Ok(Self {
            region: raw.region,
            image_id: raw.image_id,
            instance_type: raw.instance_type,
            subnet_id: raw.subnet_id,
            security_group_ids: raw.security_group_ids,
            iam_instance_profile,
            key_name: raw.key_name,
            tags: raw.tags,
            user_data: raw.user_data,
            root_volume,
            instance_metadata,
        })
    }

    /// The user data for one Machine: the placeholder replaced by its name.
    pub(crate) fn user_data_for(&self, machine: &str) -> Option<String> {
        self.user_data
            .as_ref()
            .map(|u| u.replace(MACHINE_PLACEHOLDER, machine))
    }
}

/// A region name as AWS spells them: `eu-west-1`, `us-gov-west-1`,
/// `cn-north-1`, `ap-southeast-4`.
fn check_region(r: &str) -> Result<(), SpecError> {
    let parts: Vec<&str> = r.split('-').collect();
    let ok = parts.len() >= 3
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        })
        && parts[0].chars().all(|c| c.is_ascii_lowercase())
        && parts
            .last()
            .is_some_and(|p| p.chars().all(|c| c.is_ascii_digit()));
    if ok {
        Ok(())
    } else {
        Err(bad(
            "region",
            format!("{r:?} is not an AWS region name (like eu-west-1)"),
        ))
    }
}

/// An EC2 resource id: its prefix, then 8 or 17 hexadecimal digits.
fn check_id(field: &str, id: &str, prefix: &str) -> Result<(), SpecError> {
    let ok = id
        .strip_prefix(prefix)
        .is_some_and(|hex| (hex.len() == 8 || hex.len() == 17) && is_lower_hex(hex));
    if ok {
        Ok(())
    } else {
        Err(bad(
            field,
            format!("{id:?} is not an EC2 id ({prefix} and 8 or 17 hexadecimal digits)"),
        ))
    }
}

fn is_lower_hex(s: &str) -> bool {
    s.chars()
        .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
}

/// `family.size`, like `m6i.large` or `u-6tb1.metal`.
fn check_instance_type(t: &str) -> Result<(), SpecError> {
    let ok = t.split_once('.').is_some_and(|(family, size)| {
        !family.is_empty()
            && !size.is_empty()
            && t.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-')
    });
    if ok {
        Ok(())
    } else {
        Err(bad(
            "instanceType",
            format!("{t:?} is not an instance type (like m6i.large)"),
        ))
    }
}

fn instance_profile(p: &str) -> Result<InstanceProfile, SpecError> {
    if p.starts_with("arn:") {
        let ok = p.split(':').nth(2) == Some("iam") && p.contains(":instance-profile/");
        if ok {
            Ok(InstanceProfile::Arn(p.to_string()))
        } else {
            Err(bad(
                "iamInstanceProfile",
                format!("{p:?} is not an instance-profile ARN"),
            ))
        }
    } else if !p.is_empty()
        && p.len() <= 128
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || "+=,.@-_".contains(c))
    {
        Ok(InstanceProfile::Name(p.to_string()))
    } else {
        Err(bad(
            "iamInstanceProfile",
            format!("{p:?} is not an instance-profile name or ARN"),
        ))
    }
}

fn check_tags(t: &BTreeMap<String, String>) -> Result<(), SpecError> {
    let room = MAX_TAGS - tags::OWN.len();
    if t.len() > room {
        return Err(bad(
            "tags",
            format!(
                "{} tags; EC2 takes {MAX_TAGS} and berth uses {}",
                t.len(),
                tags::OWN.len()
            ),
        ));
    }
    for (k, v) in t {
        let field = format!("tags[{k:?}]");
        if k.is_empty() || k.chars().count() > 128 {
            return Err(bad(field, "a key is 1 to 128 characters"));
        }
        if v.chars().count() > 256 {
            return Err(bad(field, "a value is at most 256 characters"));
        }
        if k.to_ascii_lowercase().starts_with("aws:") {
            return Err(bad(field, "keys starting with aws: are AWS's own"));
        }
        if tags::OWN.contains(&k.as_str()) || k.starts_with(tags::PREFIX) {
            return Err(bad(
                field,
                format!("berth sets this tag itself ({}…)", tags::PREFIX),
            ));
        }
    }
    Ok(())
}

fn check_volume(v: RawVolume) -> Result<RootVolume, SpecError> {
    if !(1..=65536).contains(&v.size_gib) {
        return Err(bad("rootVolume.sizeGiB", "must be 1 to 65536"));
    }
    if let Some(t) = &v.volume_type
        && !VOLUME_TYPES.contains(&t.as_str())
    {
        return Err(bad(
            "rootVolume.type",
            format!("{t:?} is not one of {}", VOLUME_TYPES.join(", ")),
        ));
    }
    Ok(RootVolume {
        size_gib: v.size_gib,
        volume_type: v.volume_type,
    })
}

fn check_metadata(m: RawMetadata) -> Result<InstanceMetadata, SpecError> {
    let tokens_required = match m.http_tokens.as_deref() {
        None | Some("required") => true,
        Some("optional") => false,
        Some(other) => {
            return Err(bad(
                "instanceMetadata.httpTokens",
                format!("{other:?} is not required or optional"),
            ));
        }
    };
    let hop_limit = m.hop_limit.unwrap_or(1);
    if !(1..=64).contains(&hop_limit) {
        return Err(bad("instanceMetadata.hopLimit", "must be 1 to 64"));
    }
    Ok(InstanceMetadata {
        tokens_required,
        hop_limit,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn minimal() -> serde_json::Value {
        json!({"region": "eu-west-1", "imageId": "ami-0123456789abcdef0", "instanceType": "m6i.large"})
    }

    fn with(field: &str, value: serde_json::Value) -> serde_json::Value {
        let mut v = minimal();
        v[field] = value;
        v
    }

    #[test]
    fn a_full_spec_is_read() {
        let spec = AwsSpec::parse(&json!({
            "region": "us-gov-west-1",
            "imageId": "ami-12345678",
            "instanceType": "u-6tb1.metal",
            "subnetId": "subnet-0123456789abcdef0",
            "securityGroupIds": ["sg-0123456789abcdef0", "sg-89abcdef"],
            "iamInstanceProfile": "arn:aws:iam::123456789012:instance-profile/berth",
            "keyName": "ops",
            "tags": {"team": "storage"},
            "userData": "hostname {{machine}}; echo {{machine}}",
            "rootVolume": {"sizeGiB": 50, "type": "gp3"}
        }))
        .expect("valid");
        assert_eq!(spec.security_group_ids.len(), 2);
        assert!(matches!(
            spec.iam_instance_profile,
            Some(InstanceProfile::Arn(_))
        ));
        assert_eq!(
            spec.user_data_for("db-1").as_deref(),
            Some("hostname db-1; echo db-1")
        );
        assert_eq!(
            spec.root_volume,
            Some(RootVolume {
                size_gib: 50,
                volume_type: Some("gp3".into())
            })
        );
        let min = AwsSpec::parse(&minimal()).expect("valid");
        assert_eq!(min.user_data_for("m"), None);
        assert_eq!(
            min.instance_metadata,
            InstanceMetadata {
                tokens_required: true,
                hop_limit: 1
            },
            "IMDSv2 only, not reachable from pods, unless asked"
        );
        let open = AwsSpec::parse(&with(
            "instanceMetadata",
            json!({"httpTokens": "optional", "hopLimit": 2}),
        ))
        .expect("valid");
        assert!(!open.instance_metadata.tokens_required);
        assert_eq!(open.instance_metadata.hop_limit, 2);
        assert_eq!(min.iam_instance_profile, None);
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases = [
            (serde_json::Value::Null, "providerSpec"),
            (json!({"region": "eu-west-1"}), "providerSpec"),
            (with("imageID", json!("ami-12345678")), "providerSpec"),
            (with("region", json!("Europe")), "region"),
            (with("region", json!("eu-west")), "region"),
            (with("imageId", json!("ami-xyz")), "imageId"),
            (with("imageId", json!("img-12345678")), "imageId"),
            (with("instanceType", json!("large")), "instanceType"),
            (with("instanceType", json!("M6i.large")), "instanceType"),
            (with("subnetId", json!("subnet-1")), "subnetId"),
            (
                with("securityGroupIds", json!(["sg-12345678", "default"])),
                "securityGroupIds[1]",
            ),
            (
                with("iamInstanceProfile", json!("arn:aws:s3:::bucket")),
                "iamInstanceProfile",
            ),
            (
                with("iamInstanceProfile", json!("has space")),
                "iamInstanceProfile",
            ),
            (with("keyName", json!("")), "keyName"),
            (with("tags", json!({"aws:foo": "x"})), "tags[\"aws:foo\"]"),
            (
                with("tags", json!({"berth.dev/cluster": "other"})),
                "tags[\"berth.dev/cluster\"]",
            ),
            (with("tags", json!({"k": "v".repeat(257)})), "tags[\"k\"]"),
            (
                with("userData", json!("x".repeat(16 * 1024 + 1))),
                "userData",
            ),
            (
                with("rootVolume", json!({"sizeGiB": 0})),
                "rootVolume.sizeGiB",
            ),
            (
                with("rootVolume", json!({"sizeGiB": 8, "type": "ssd"})),
                "rootVolume.type",
            ),
            (with("rootVolume", json!({"size": 8})), "providerSpec"),
            (
                with("instanceMetadata", json!({"httpTokens": "v1"})),
                "instanceMetadata.httpTokens",
            ),
            (
                with("instanceMetadata", json!({"hopLimit": 0})),
                "instanceMetadata.hopLimit",
            ),
        ];
        for (spec, field) in cases {
            let err = AwsSpec::parse(&spec).expect_err(&format!("{spec} must be refused"));
            assert_eq!(err.field, field, "{spec}: {err}");
        }
    }

    #[test]
    fn the_example_class_is_valid() {
        let class: serde_yaml_ng::Value = serde_yaml_ng::from_str(include_str!(
            "../../../deploy/examples/machineclass-aws.yaml"
        ))
        .expect("YAML");
        let spec: serde_json::Value =
            serde_json::to_value(&class["spec"]["providerSpec"]).expect("JSON");
        let spec = AwsSpec::parse(&spec).expect("the example is valid");
        assert!(
            spec.user_data_for("m")
                .is_some_and(|u| u.contains("machine=m"))
        );
    }

    #[test]
    fn too_many_tags_leave_no_room_for_berths_own() {
        let many: BTreeMap<String, String> = (0..=(MAX_TAGS - tags::OWN.len()))
            .map(|i| (format!("k{i}"), "v".into()))
            .collect();
        let err = AwsSpec::parse(&with("tags", json!(many))).expect_err("too many");
        assert_eq!(err.field, "tags");
        let fits: BTreeMap<String, String> = many.into_iter().skip(1).collect();
        assert!(AwsSpec::parse(&with("tags", json!(fits))).is_ok());
    }
}
