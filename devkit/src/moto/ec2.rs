//! A small EC2 Query API client for tests: seeds moto with instances (the
//! orphans, untagged and young instances a test needs), reads their state
//! back, and is what the [`MotoKubelet`](super::kubelet::MotoKubelet)
//! watches moto with.
//!
//! It speaks what the `aws` provider speaks — `POST /` with a form body
//! `Action=…&Version=2016-11-15&…`, HTTP/1.1 — with a syntactically valid
//! SigV4 `Authorization` header that names the region in its credential
//! scope (moto reads the region from there and checks no signature). It is
//! test infrastructure, not a second provider: it neither retries nor
//! paces itself.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::xml::Element;

/// The EC2 API version every request names.
pub const API_VERSION: &str = "2016-11-15";

#[derive(Debug, Clone, thiserror::Error)]
pub enum Ec2Error {
    #[error("{action}: no answer from {endpoint}: {reason}")]
    Http {
        action: String,
        endpoint: String,
        reason: String,
    },
    #[error("{action}: HTTP {status} {code}: {message}")]
    Api {
        action: String,
        status: u16,
        code: String,
        message: String,
    },
    #[error("{action}: an answer that is not EC2's (HTTP {status}): {reason}")]
    Unreadable {
        action: String,
        status: u16,
        reason: String,
    },
}

impl Ec2Error {
    /// EC2's error code (`InvalidInstanceID.NotFound`, …), when EC2 (or
    /// moto) answered with its error document.
    pub fn code(&self) -> Option<&str> {
        match self {
            Ec2Error::Api { code, .. } => Some(code),
            _ => None,
        }
    }
}

/// An EC2 error document, as EC2 sends it and as the
/// [`FaultProxy`](super::proxy::FaultProxy) forges it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorDocument {
    pub code: String,
    pub message: String,
    pub request_id: String,
}

impl ErrorDocument {
    /// Reads `<Response><Errors><Error><Code>…` (the first error).
    pub fn parse(body: &str) -> Option<ErrorDocument> {
        let root = Element::parse(body).ok()?;
        if root.name != "Response" {
            return None;
        }
        let error = root.at(&["Errors", "Error"])?;
        Some(ErrorDocument {
            code: error.text_at(&["Code"])?,
            message: error.text_at(&["Message"]).unwrap_or_default(),
            request_id: root.text_at(&["RequestID"]).unwrap_or_default(),
        })
    }
}

/// An instance as `DescribeInstances` and `RunInstances` describe it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Instance {
    pub id: String,
    /// `pending`, `running`, `shutting-down`, `terminated`, `stopping`,
    /// `stopped`.
    pub state: String,
    /// `placement.availabilityZone`.
    pub zone: Option<String>,
    pub private_dns_name: Option<String>,
    pub private_ip: Option<String>,
    pub instance_type: Option<String>,
    /// `x86_64` or `arm64`.
    pub architecture: Option<String>,
    /// As EC2 writes it: `2026-01-01T00:00:00.000Z`.
    pub launch_time: Option<String>,
    pub image_id: Option<String>,
    pub subnet_id: Option<String>,
    pub client_token: Option<String>,
    pub tags: BTreeMap<String, String>,
}

impl Instance {
    fn from_xml(item: &Element) -> Option<Instance> {
        let text = |path: &[&str]| item.text_at(path);
        Some(Instance {
            id: text(&["instanceId"])?,
            state: text(&["instanceState", "name"]).unwrap_or_default(),
            zone: text(&["placement", "availabilityZone"]),
            private_dns_name: text(&["privateDnsName"]),
            private_ip: text(&["privateIpAddress"]),
            instance_type: text(&["instanceType"]),
            architecture: text(&["architecture"]),
            launch_time: text(&["launchTime"]),
            image_id: text(&["imageId"]),
            subnet_id: text(&["subnetId"]),
            client_token: text(&["clientToken"]),
            tags: tags(item),
        })
    }

    /// `aws:///<availability-zone>/<instance-id>`, the providerID the AWS
    /// cloud provider gives its Node (when the zone is known).
    pub fn provider_id(&self) -> Option<String> {
        Some(format!("aws:///{}/{}", self.zone.as_ref()?, self.id))
    }
}

/// A subnet as `DescribeSubnets` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subnet {
    pub id: String,
    pub zone: String,
    pub vpc_id: String,
    pub default_for_az: bool,
}

/// An EBS volume as `DescribeVolumes` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    pub id: String,
    /// `creating`, `available`, `in-use`, `deleting`, …
    pub state: String,
    pub zone: Option<String>,
    /// The instances it is attached to.
    pub attached_to: Vec<String>,
    pub tags: BTreeMap<String, String>,
}

/// What [`Ec2::launch`] launches: one instance, with these tags.
#[derive(Debug, Clone, Default)]
pub struct Launch {
    /// Tags on the instance (`TagSpecification` `ResourceType=instance`).
    pub tags: BTreeMap<String, String>,
    /// Tags on its volumes (`ResourceType=volume`), none when empty.
    pub volume_tags: BTreeMap<String, String>,
    /// `t3.micro` unless set.
    pub instance_type: Option<String>,
    /// The default subnet of this zone; of the first zone unless set.
    pub zone: Option<String>,
    /// An image moto ships ([`Ec2::image_id`]) unless set.
    pub image_id: Option<String>,
    pub client_token: Option<String>,
}

impl Launch {
    /// An instance with these tags.
    pub fn tagged(tags: &[(&str, &str)]) -> Self {
        Launch {
            tags: pairs(tags),
            ..Default::default()
        }
    }

    pub fn tag(mut self, key: &str, value: &str) -> Self {
        self.tags.insert(key.into(), value.into());
        self
    }

    pub fn volume_tag(mut self, key: &str, value: &str) -> Self {
        self.volume_tags.insert(key.into(), value.into());
        self
    }

    pub fn zone(mut self, zone: &str) -> Self {
        self.zone = Some(zone.into());
        self
    }

    pub fn instance_type(mut self, instance_type: &str) -> Self {
        self.instance_type = Some(instance_type.into());
        self
    }

    pub fn client_token(mut self, token: &str) -> Self {
        self.client_token = Some(token.into());
        self
    }
}

/// An EC2 Query API client for one endpoint and region. Cheap to clone.
#[derive(Clone)]
pub struct Ec2 {
    endpoint: String,
    region: String,
    http: Client<HttpConnector, Full<Bytes>>,
    image: Arc<tokio::sync::OnceCell<String>>,
}

impl std::fmt::Debug for Ec2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ec2")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .finish()
    }
}

impl Ec2 {
    /// A client of `endpoint` (`http://127.0.0.1:<port>`: moto's, or a
    /// [`FaultProxy`](super::proxy::FaultProxy)'s) for `region`.
    pub fn new(endpoint: &str, region: &str) -> Self {
        Ec2 {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            region: region.to_string(),
            http: Client::builder(TokioExecutor::new()).build_http(),
            image: Default::default(),
        }
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn region(&self) -> &str {
        &self.region
    }

    /// Sends a form body as it is (`Action=…&Version=…&…`) and returns the
    /// HTTP status and body, whatever they are.
    pub async fn send(&self, form: &str) -> Result<(u16, String), Ec2Error> {
        let action = action_of(form);
        let http_error = |reason: String| Ec2Error::Http {
            action: action.clone(),
            endpoint: self.endpoint.clone(),
            reason,
        };
        let auth = format!(
            "AWS4-HMAC-SHA256 Credential=testing/20260101/{}/ec2/aws4_request, \
             SignedHeaders=content-type;host;x-amz-date, Signature={}",
            self.region,
            "0".repeat(64)
        );
        let req = http::Request::post(format!("{}/", self.endpoint))
            .header(
                http::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded; charset=utf-8",
            )
            .header("x-amz-date", "20260101T000000Z")
            .header(http::header::AUTHORIZATION, auth)
            .body(Full::new(Bytes::from(form.to_string())))
            .map_err(|e| http_error(e.to_string()))?;
        let resp = self
            .http
            .request(req)
            .await
            .map_err(|e| http_error(format!("{e:?}")))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| http_error(e.to_string()))?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    /// Calls `action` with `params` and returns the parsed answer, or EC2's
    /// error.
    pub async fn call<K, V>(&self, action: &str, params: &[(K, V)]) -> Result<Element, Ec2Error>
    where
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let form = {
            let mut form = form_urlencoded::Serializer::new(String::new());
            form.append_pair("Action", action)
                .append_pair("Version", API_VERSION);
            for (k, v) in params {
                form.append_pair(k.as_ref(), v.as_ref());
            }
            form.finish()
        };
        let (status, body) = self.send(&form).await?;
        if (200..300).contains(&status) {
            return Element::parse(&body).map_err(|reason| Ec2Error::Unreadable {
                action: action.into(),
                status,
                reason,
            });
        }
        match ErrorDocument::parse(&body) {
            Some(e) => Err(Ec2Error::Api {
                action: action.into(),
                status,
                code: e.code,
                message: e.message,
            }),
            None => Err(Ec2Error::Unreadable {
                action: action.into(),
                status,
                reason: format!("not an error document: {:?}", clip(&body)),
            }),
        }
    }

    /// An image moto ships: an Amazon Linux x86_64 one when there is one,
    /// else any available image (found once per client with
    /// `DescribeImages`).
    pub async fn image_id(&self) -> Result<String, Ec2Error> {
        self.image
            .get_or_try_init(|| async {
                for filters in [
                    vec![
                        (
                            "name",
                            vec!["amzn2-ami-hvm-*-x86_64-gp2", "amzn-ami-hvm-*-x86_64-gp2"],
                        ),
                        ("architecture", vec!["x86_64"]),
                        ("state", vec!["available"]),
                    ],
                    vec![("state", vec!["available"])],
                ] {
                    let mut params = vec![("Owner.1".to_string(), "amazon".to_string())];
                    params.extend(filter_params(&filters));
                    let answer = self.call("DescribeImages", &params).await?;
                    let mut images: Vec<(String, String)> = answer
                        .items("imagesSet")
                        .filter_map(|i| Some((i.text_at(&["name"])?, i.text_at(&["imageId"])?)))
                        .collect();
                    // The newest name first, so the choice does not depend
                    // on moto's order.
                    images.sort();
                    if let Some((_, id)) = images.pop() {
                        return Ok(id);
                    }
                }
                Err(Ec2Error::Unreadable {
                    action: "DescribeImages".into(),
                    status: 200,
                    reason: "moto knows no image".into(),
                })
            })
            .await
            .cloned()
    }

    /// The default VPC's subnets, one a zone, by zone.
    pub async fn default_subnets(&self) -> Result<Vec<Subnet>, Ec2Error> {
        let answer = self
            .call(
                "DescribeSubnets",
                &filter_params(&[("default-for-az", vec!["true"])]),
            )
            .await?;
        let mut subnets: Vec<Subnet> = answer
            .items("subnetSet")
            .filter_map(|s| {
                Some(Subnet {
                    id: s.text_at(&["subnetId"])?,
                    zone: s.text_at(&["availabilityZone"])?,
                    vpc_id: s.text_at(&["vpcId"]).unwrap_or_default(),
                    default_for_az: s.text_at(&["defaultForAz"]).as_deref() == Some("true"),
                })
            })
            .collect();
        subnets.sort_by(|a, b| a.zone.cmp(&b.zone));
        Ok(subnets)
    }

    /// Launches one instance (`RunInstances`, `MinCount=MaxCount=1`) in a
    /// default subnet, and returns it as `RunInstances` described it (moto
    /// says `pending`; `DescribeInstances` says `running` at once).
    pub async fn launch(&self, launch: &Launch) -> Result<Instance, Ec2Error> {
        let subnets = self.default_subnets().await?;
        let subnet = match &launch.zone {
            Some(zone) => subnets.iter().find(|s| &s.zone == zone),
            None => subnets.first(),
        }
        .ok_or_else(|| Ec2Error::Unreadable {
            action: "DescribeSubnets".into(),
            status: 200,
            reason: format!(
                "no default subnet in {}",
                launch.zone.as_deref().unwrap_or(&self.region)
            ),
        })?;
        let image = match &launch.image_id {
            Some(image) => image.clone(),
            None => self.image_id().await?,
        };
        let mut params: Vec<(String, String)> = [
            ("ImageId", image.as_str()),
            (
                "InstanceType",
                launch.instance_type.as_deref().unwrap_or("t3.micro"),
            ),
            ("MinCount", "1"),
            ("MaxCount", "1"),
            ("SubnetId", subnet.id.as_str()),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        if let Some(token) = &launch.client_token {
            params.push(("ClientToken".into(), token.clone()));
        }
        let specs = [("instance", &launch.tags), ("volume", &launch.volume_tags)];
        let specs = specs.iter().filter(|(_, tags)| !tags.is_empty());
        for (n, (resource, tags)) in specs.enumerate() {
            let spec = format!("TagSpecification.{}", n + 1);
            params.push((format!("{spec}.ResourceType"), resource.to_string()));
            for (m, (k, v)) in tags.iter().enumerate() {
                params.push((format!("{spec}.Tag.{}.Key", m + 1), k.clone()));
                params.push((format!("{spec}.Tag.{}.Value", m + 1), v.clone()));
            }
        }
        let answer = self.call("RunInstances", &params).await?;
        answer
            .items("instancesSet")
            .find_map(Instance::from_xml)
            .ok_or_else(|| Ec2Error::Unreadable {
                action: "RunInstances".into(),
                status: 200,
                reason: "no instance in the answer".into(),
            })
    }

    /// Every instance that matches `filters` (`DescribeInstances`, every
    /// page), in the order EC2 gave them.
    pub async fn instances(&self, filters: &[(&str, &[&str])]) -> Result<Vec<Instance>, Ec2Error> {
        let filters: Vec<(&str, Vec<&str>)> =
            filters.iter().map(|(n, v)| (*n, v.to_vec())).collect();
        self.describe_instances(filter_params(&filters)).await
    }

    /// Every instance with the tag `key=value`, whatever its state.
    pub async fn instances_tagged(
        &self,
        key: &str,
        value: &str,
    ) -> Result<Vec<Instance>, Ec2Error> {
        self.instances(&[(&format!("tag:{key}"), &[value])]).await
    }

    /// One instance by id; `None` when EC2 does not know it.
    pub async fn instance(&self, id: &str) -> Result<Option<Instance>, Ec2Error> {
        match self
            .describe_instances(vec![("InstanceId.1".into(), id.into())])
            .await
        {
            Ok(mut found) => Ok(found.pop()),
            Err(e) if e.code() == Some("InvalidInstanceID.NotFound") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// An instance's state (`running`, `terminated`, …); `None` when EC2
    /// does not know it.
    pub async fn instance_state(&self, id: &str) -> Result<Option<String>, Ec2Error> {
        Ok(self.instance(id).await?.map(|i| i.state))
    }

    async fn describe_instances(
        &self,
        params: Vec<(String, String)>,
    ) -> Result<Vec<Instance>, Ec2Error> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut page = params.clone();
            if let Some(t) = &token {
                page.push(("NextToken".into(), t.clone()));
            }
            let answer = self.call("DescribeInstances", &page).await?;
            out.extend(
                answer
                    .items("reservationSet")
                    .flat_map(|r| r.items("instancesSet"))
                    .filter_map(Instance::from_xml),
            );
            token = answer.text_at(&["nextToken"]);
            if token.is_none() {
                return Ok(out);
            }
        }
    }

    /// `TerminateInstances`.
    pub async fn terminate(&self, ids: &[&str]) -> Result<(), Ec2Error> {
        self.call("TerminateInstances", &numbered("InstanceId", ids))
            .await
            .map(|_| ())
    }

    /// `StopInstances`.
    pub async fn stop(&self, ids: &[&str]) -> Result<(), Ec2Error> {
        self.call("StopInstances", &numbered("InstanceId", ids))
            .await
            .map(|_| ())
    }

    /// `StartInstances`.
    pub async fn start(&self, ids: &[&str]) -> Result<(), Ec2Error> {
        self.call("StartInstances", &numbered("InstanceId", ids))
            .await
            .map(|_| ())
    }

    /// The volumes attached to an instance (`DescribeVolumes` filtered by
    /// `attachment.instance-id`).
    pub async fn volumes_of(&self, instance_id: &str) -> Result<Vec<Volume>, Ec2Error> {
        let answer = self
            .call(
                "DescribeVolumes",
                &filter_params(&[("attachment.instance-id", vec![instance_id])]),
            )
            .await?;
        Ok(answer
            .items("volumeSet")
            .filter_map(|v| {
                Some(Volume {
                    id: v.text_at(&["volumeId"])?,
                    state: v.text_at(&["status"]).unwrap_or_default(),
                    zone: v.text_at(&["availabilityZone"]),
                    attached_to: v
                        .items("attachmentSet")
                        .filter_map(|a| a.text_at(&["instanceId"]))
                        .collect(),
                    tags: tags(v),
                })
            })
            .collect())
    }
}

/// The `tagSet` of an EC2 item.
fn tags(item: &Element) -> BTreeMap<String, String> {
    item.items("tagSet")
        .filter_map(|t| {
            Some((
                t.text_at(&["key"])?,
                t.text_at(&["value"]).unwrap_or_default(),
            ))
        })
        .collect()
}

fn pairs(tags: &[(&str, &str)]) -> BTreeMap<String, String> {
    tags.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `Filter.N.Name` / `Filter.N.Value.M` parameters.
fn filter_params(filters: &[(&str, Vec<&str>)]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (n, (name, values)) in filters.iter().enumerate() {
        out.push((format!("Filter.{}.Name", n + 1), name.to_string()));
        for (m, v) in values.iter().enumerate() {
            out.push((format!("Filter.{}.Value.{}", n + 1, m + 1), v.to_string()));
        }
    }
    out
}

/// `<prefix>.1=…&<prefix>.2=…` parameters.
fn numbered(prefix: &str, values: &[&str]) -> Vec<(String, String)> {
    values
        .iter()
        .enumerate()
        .map(|(n, v)| (format!("{prefix}.{}", n + 1), v.to_string()))
        .collect()
}

/// The `Action` of a form body (or query string), `None` when it names
/// none.
pub fn action_param(form: &str) -> Option<String> {
    form_urlencoded::parse(form.as_bytes())
        .find(|(k, _)| k == "Action")
        .map(|(_, v)| v.into_owned())
}

fn action_of(form: &str) -> String {
    action_param(form).unwrap_or_else(|| "(no Action)".into())
}

fn clip(body: &str) -> String {
    body.chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ec2_error_documents_and_only_those() {
        let doc = r#"<?xml version="1.0" encoding="UTF-8"?>
<Response><Errors><Error><Code>RequestLimitExceeded</Code><Message>Request limit exceeded.</Message></Error></Errors><RequestID>abc</RequestID></Response>"#;
        assert_eq!(
            ErrorDocument::parse(doc),
            Some(ErrorDocument {
                code: "RequestLimitExceeded".into(),
                message: "Request limit exceeded.".into(),
                request_id: "abc".into(),
            })
        );
        assert_eq!(ErrorDocument::parse(""), None);
        assert_eq!(ErrorDocument::parse("<html>502</html>"), None);
    }

    #[test]
    fn builds_filters_and_numbered_parameters_as_the_query_api_wants_them() {
        let f = filter_params(&[
            ("tag:a", vec!["1", "2"]),
            ("instance-state-name", vec!["running"]),
        ]);
        let f: Vec<String> = f.iter().map(|(k, v)| format!("{k}={v}")).collect();
        assert_eq!(
            f,
            [
                "Filter.1.Name=tag:a",
                "Filter.1.Value.1=1",
                "Filter.1.Value.2=2",
                "Filter.2.Name=instance-state-name",
                "Filter.2.Value.1=running"
            ]
        );
        assert_eq!(
            numbered("InstanceId", &["i-1", "i-2"])[1],
            ("InstanceId.2".into(), "i-2".into())
        );
        assert_eq!(
            action_param("Version=2016-11-15&Action=RunInstances").as_deref(),
            Some("RunInstances")
        );
        assert_eq!(action_param("Version=2016-11-15"), None);
    }
}
