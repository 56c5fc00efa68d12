//! A small client for the EC2 Query API: the four calls berth makes
//! (`RunInstances`, `DescribeInstances`, `TerminateInstances`,
//! `DescribeImages`), signed with AWS's own SigV4 crate and sent over the
//! same hyper/rustls stack the Kubernetes client uses.
//!
//! Building the form and reading the answers are pure functions, tested
//! beside the code against EC2's documented response shapes; what EC2 says
//! about a failure is turned into berth's error classes in
//! [`super::errors`].

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
use aws_sigv4::sign::v4;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::jiff::Timestamp;

/// The EC2 API version berth speaks.
const VERSION: &str = "2016-11-15";
/// How long one request may take before it counts as a transient failure.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) type Http = HyperClient<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// An HTTPS (or, for an emulator on loopback, HTTP) client with the
/// system's trust roots.
pub(crate) fn http() -> std::io::Result<Http> {
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_native_roots(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))?
        .https_or_http()
        .enable_http1()
        .build();
    Ok(HyperClient::builder(TokioExecutor::new()).build(https))
}

/// One failed call, as EC2 (or the way to it) reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CallError {
    /// The HTTP status; `None` when no answer came (connection, timeout).
    pub status: Option<u16>,
    /// EC2's error code (`RequestLimitExceeded`, `InvalidAMIID.NotFound`,
    /// …), or a word of ours when the answer had none.
    pub code: String,
    pub message: String,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.status {
            Some(s) => write!(f, "{} (HTTP {s}): {}", self.code, self.message),
            None => write!(f, "{}: {}", self.code, self.message),
        }
    }
}

/// Where and as whom to call EC2.
pub(crate) struct Ec2<'a> {
    pub http: &'a Http,
    pub endpoint: &'a str,
    pub region: &'a str,
    pub credentials: &'a Credentials,
}

impl Ec2<'_> {
    /// Sends one call and returns the XML answer of a 2xx.
    pub(crate) async fn call(
        &self,
        action: &str,
        params: &[(String, String)],
    ) -> Result<String, CallError> {
        let body = form(action, params);
        let request = self.signed(body).map_err(|e| CallError {
            status: None,
            code: "Signing".into(),
            message: e,
        })?;
        let answer = tokio::time::timeout(REQUEST_TIMEOUT, async {
            let response = self.http.request(request).await.map_err(|e| CallError {
                status: None,
                code: "Transport".into(),
                message: error_chain(&e),
            })?;
            let status = response.status().as_u16();
            let bytes = response
                .into_body()
                .collect()
                .await
                .map_err(|e| CallError {
                    status: Some(status),
                    code: "Transport".into(),
                    message: e.to_string(),
                })?
                .to_bytes();
            Ok::<_, CallError>((status, String::from_utf8_lossy(&bytes).into_owned()))
        })
        .await
        .map_err(|_| CallError {
            status: None,
            code: "Timeout".into(),
            message: format!("no answer within {REQUEST_TIMEOUT:?}"),
        })??;
        let (status, text) = answer;
        if (200..300).contains(&status) {
            Ok(text)
        } else {
            Err(error_of(status, &text))
        }
    }

    fn signed(&self, body: String) -> Result<http::Request<Full<Bytes>>, String> {
        let identity = self.credentials.clone().into();
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region(self.region)
            .name("ec2")
            .time(SystemTime::now())
            .settings(SigningSettings::default())
            .build()
            .map_err(|e| e.to_string())?
            .into();
        let content_type = "application/x-www-form-urlencoded; charset=utf-8";
        let signable = SignableRequest::new(
            "POST",
            self.endpoint,
            std::iter::once(("content-type", content_type)),
            SignableBody::Bytes(body.as_bytes()),
        )
        .map_err(|e| e.to_string())?;
        let (instructions, _) = sign(signable, &params)
            .map_err(|e| e.to_string())?
            .into_parts();
        let mut request = http::Request::builder()
            .method("POST")
            .uri(self.endpoint)
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        instructions.apply_to_request_http1x(&mut request);
        Ok(request)
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// The form body of a call: `Action`, `Version`, then the parameters, each
/// percent-encoded as AWS's Query protocol expects.
pub(crate) fn form(action: &str, params: &[(String, String)]) -> String {
    let mut out = format!("Action={}&Version={VERSION}", encode(action));
    for (k, v) in params {
        out.push('&');
        out.push_str(&encode(k));
        out.push('=');
        out.push_str(&encode(v));
    }
    out
}

/// RFC 3986 percent-encoding: everything but `A–Z a–z 0–9 - _ . ~`.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The error of a non-2xx answer: EC2's `<Response><Errors><Error>` (or the
/// `<ErrorResponse>` of other Query services), or, for a body that is not
/// one (a load balancer's page), the status alone.
pub(crate) fn error_of(status: u16, body: &str) -> CallError {
    let parsed = roxmltree::Document::parse(body).ok().and_then(|doc| {
        let error = doc.descendants().find(|n| n.has_tag_name("Error"))?;
        let code = child_text(error, "Code")?;
        let message = child_text(error, "Message").unwrap_or_default();
        Some((code, message))
    });
    match parsed {
        Some((code, message)) => CallError {
            status: Some(status),
            code,
            message,
        },
        None => CallError {
            status: Some(status),
            code: format!("HTTP{status}"),
            message: body.chars().take(200).collect(),
        },
    }
}

/// An instance as berth reads it from EC2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Instance {
    pub id: String,
    /// `pending`, `running`, `shutting-down`, `terminated`, `stopping`,
    /// `stopped`.
    pub state: String,
    pub zone: String,
    pub launched: Option<Timestamp>,
    pub tags: BTreeMap<String, String>,
}

/// The instances of a `RunInstances`, `DescribeInstances` (every
/// reservation) or `TerminateInstances` answer. `TerminateInstances` has
/// no placement and gives the state as `currentState`.
pub(crate) fn instances(xml: &str) -> Result<Vec<Instance>, String> {
    let doc = roxmltree::Document::parse(xml).map_err(|e| format!("EC2 answer: {e}"))?;
    let mut out = Vec::new();
    for set in doc.descendants().filter(|n| n.has_tag_name("instancesSet")) {
        for item in set.children().filter(|n| n.has_tag_name("item")) {
            let id = child_text(item, "instanceId")
                .ok_or_else(|| "EC2 answer: an instance without instanceId".to_string())?;
            let state = ["instanceState", "currentState"]
                .iter()
                .find_map(|s| child(item, s).and_then(|st| child_text(st, "name")))
                .unwrap_or_default();
            let zone = child(item, "placement")
                .and_then(|p| child_text(p, "availabilityZone"))
                .unwrap_or_default();
            let launched = child_text(item, "launchTime").and_then(|t| t.parse().ok());
            let tags = child(item, "tagSet")
                .map(|set| {
                    set.children()
                        .filter(|n| n.has_tag_name("item"))
                        .filter_map(|t| {
                            Some((
                                child_text(t, "key")?,
                                child_text(t, "value").unwrap_or_default(),
                            ))
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push(Instance {
                id,
                state,
                zone,
                launched,
                tags,
            });
        }
    }
    Ok(out)
}

/// The `nextToken` of a paged answer, if there are more pages.
pub(crate) fn next_token(xml: &str) -> Option<String> {
    let doc = roxmltree::Document::parse(xml).ok()?;
    let root = doc.root_element();
    child_text(root, "nextToken").filter(|t| !t.is_empty())
}

/// The root device name of the image in a `DescribeImages` answer.
pub(crate) fn root_device_name(xml: &str) -> Option<String> {
    let doc = roxmltree::Document::parse(xml).ok()?;
    let image = doc
        .descendants()
        .find(|n| n.has_tag_name("imagesSet"))?
        .children()
        .find(|n| n.has_tag_name("item"))?;
    child_text(image, "rootDeviceName")
}

fn child<'a, 'i>(n: roxmltree::Node<'a, 'i>, name: &str) -> Option<roxmltree::Node<'a, 'i>> {
    n.children().find(|c| c.has_tag_name(name))
}

fn child_text(n: roxmltree::Node<'_, '_>, name: &str) -> Option<String> {
    child(n, name).map(|c| c.text().unwrap_or_default().trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_form_is_percent_encoded_as_the_query_protocol_wants() {
        let body = form(
            "RunInstances",
            &[
                (
                    "TagSpecification.1.Tag.1.Key".into(),
                    "berth.dev/cluster".into(),
                ),
                ("UserData".into(), "a+b/c= d~".into()),
            ],
        );
        assert_eq!(
            body,
            "Action=RunInstances&Version=2016-11-15\
             &TagSpecification.1.Tag.1.Key=berth.dev%2Fcluster\
             &UserData=a%2Bb%2Fc%3D%20d~"
        );
    }

    #[test]
    fn ec2_errors_are_read_and_other_bodies_keep_their_status() {
        let e = error_of(
            503,
            r#"<?xml version="1.0" encoding="UTF-8"?>
<Response><Errors><Error><Code>RequestLimitExceeded</Code><Message>Request limit exceeded.</Message></Error></Errors><RequestID>r-1</RequestID></Response>"#,
        );
        assert_eq!(e.code, "RequestLimitExceeded");
        assert_eq!(e.message, "Request limit exceeded.");
        assert_eq!(e.status, Some(503));
        let sts = error_of(
            403,
            "<ErrorResponse><Error><Type>Sender</Type><Code>AccessDenied</Code></Error></ErrorResponse>",
        );
        assert_eq!(sts.code, "AccessDenied");
        let html = error_of(502, "<html><body>Bad Gateway</body></html>");
        assert_eq!(html.code, "HTTP502");
        let empty = error_of(500, "");
        assert_eq!(empty.code, "HTTP500");
    }

    const DESCRIBE: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
  <requestId>x</requestId>
  <reservationSet>
    <item>
      <reservationId>r-1</reservationId>
      <instancesSet>
        <item>
          <instanceId>i-0123456789abcdef0</instanceId>
          <imageId>ami-12345678</imageId>
          <instanceState><code>16</code><name>running</name></instanceState>
          <placement><availabilityZone>eu-west-1b</availabilityZone><tenancy>default</tenancy></placement>
          <launchTime>2026-11-23T10:00:00.000Z</launchTime>
          <blockDeviceMapping><item><deviceName>/dev/xvda</deviceName></item></blockDeviceMapping>
          <tagSet>
            <item><key>berth.dev/cluster</key><value>prod</value></item>
            <item><key>empty</key><value/></item>
          </tagSet>
        </item>
      </instancesSet>
    </item>
    <item>
      <instancesSet>
        <item>
          <instanceId>i-89abcdef</instanceId>
          <instanceState><code>48</code><name>terminated</name></instanceState>
          <placement><availabilityZone>eu-west-1a</availabilityZone></placement>
        </item>
      </instancesSet>
    </item>
  </reservationSet>
  <nextToken>page-2</nextToken>
</DescribeInstancesResponse>"#;

    #[test]
    fn instances_are_read_from_every_reservation() {
        let got = instances(DESCRIBE).expect("parses");
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].id, "i-0123456789abcdef0");
        assert_eq!(got[0].state, "running");
        assert_eq!(got[0].zone, "eu-west-1b");
        assert_eq!(
            got[0].launched,
            Some("2026-11-23T10:00:00Z".parse().expect("ts"))
        );
        assert_eq!(
            got[0].tags.get("berth.dev/cluster").map(String::as_str),
            Some("prod")
        );
        assert_eq!(got[0].tags.get("empty").map(String::as_str), Some(""));
        assert_eq!(got[0].tags.len(), 2, "block device items are not tags");
        assert_eq!(got[1].state, "terminated");
        assert!(got[1].tags.is_empty());
        assert_eq!(next_token(DESCRIBE).as_deref(), Some("page-2"));
        assert!(instances("not xml").is_err());
    }

    #[test]
    fn a_terminate_answer_gives_the_current_state() {
        let xml = r#"<TerminateInstancesResponse><instancesSet><item><instanceId>i-89abcdef</instanceId>
<currentState><code>32</code><name>shutting-down</name></currentState>
<previousState><code>16</code><name>running</name></previousState></item></instancesSet></TerminateInstancesResponse>"#;
        let got = instances(xml).expect("parses");
        assert_eq!(got[0].state, "shutting-down");
        assert_eq!(next_token(xml), None);
    }

    #[test]
    fn the_root_device_comes_from_the_image() {
        let xml = r#"<DescribeImagesResponse><imagesSet><item><imageId>ami-12345678</imageId>
<rootDeviceName>/dev/sda1</rootDeviceName><blockDeviceMapping><item><deviceName>/dev/sdb</deviceName></item></blockDeviceMapping></item></imagesSet></DescribeImagesResponse>"#;
        assert_eq!(root_device_name(xml).as_deref(), Some("/dev/sda1"));
        assert_eq!(
            root_device_name("<DescribeImagesResponse><imagesSet/></DescribeImagesResponse>"),
            None
        );
    }

    /// The signature itself is AWS's crate's (tested there against AWS's
    /// SigV4 suite); what is ours is what goes into it: the scope EC2
    /// checks (region, service), the headers signed, the session token.
    #[test]
    fn requests_are_signed_for_ec2_in_the_region() {
        let creds = Credentials::new("AKIDEXAMPLE", "secret", Some("token".into()), None, "test");
        let http = http().expect("client");
        let ec2 = Ec2 {
            http: &http,
            endpoint: "https://ec2.eu-west-1.amazonaws.com/",
            region: "eu-west-1",
            credentials: &creds,
        };
        let req = ec2.signed(form("DescribeInstances", &[])).expect("signed");
        let auth = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .expect("authorization")
            .to_string();
        assert!(
            auth.starts_with("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/"),
            "{auth}"
        );
        assert!(auth.contains("/eu-west-1/ec2/aws4_request"), "{auth}");
        assert!(
            auth.contains("SignedHeaders=content-type;host;x-amz-date;x-amz-security-token"),
            "{auth}"
        );
        assert_eq!(
            req.headers()
                .get("x-amz-security-token")
                .and_then(|v| v.to_str().ok()),
            Some("token")
        );
        assert!(!format!("{:?}", req.headers()).contains("secret"));
    }
}
