//! moto's EC2 server: the real emulator (not a mock of ours) that the `aws`
//! provider is tested against, as a process on a loopback port of its own.
//!
//! moto is installed from the pins in `hack/moto/requirements.txt` into a
//! virtualenv cached outside the repository (`hack/moto/install.sh`), the
//! way the test control plane is built. Each [`Moto`] is its own server, so
//! tests never see each other's instances; it is killed when dropped, and
//! by the kernel if the test process dies (the test bed's supervisor).
//!
//! - [`ec2`]: a small EC2 Query API client to seed moto (instances with
//!   tags, in a default subnet, from an image moto ships) and read it back;
//! - [`proxy`]: a fault-injecting HTTP proxy in front of moto, for the
//!   errors moto never makes (throttling, 5xx, a load balancer's HTML);
//! - [`kubelet`]: the joining kubelet, which registers a kwok Node for each
//!   running instance of a cluster, as the AWS cloud provider would;
//! - [`xml`]: the small XML reader they share.
//!
//! moto is not EC2. Tests must not depend on where they differ, and the
//! provider must not rely on anything moto accepts that EC2 refuses. Seen
//! with moto 5.2.5:
//!
//! - instances run at once: `RunInstances` answers `pending`, the next
//!   `DescribeInstances` says `running`; `TerminateInstances` answers
//!   `shutting-down`, and the instance is `terminated` at once (and stays
//!   listed, its `privateDnsName` and address kept, which EC2 clears);
//!   terminating it again answers `shutting-down` (EC2: `terminated`);
//! - client tokens are echoed but not honoured: a second `RunInstances`
//!   with the same `ClientToken` launches a second instance;
//! - an unknown image or instance type is accepted; a malformed instance id
//!   is `InvalidInstanceID.NotFound` (EC2: `…Malformed`);
//! - `launchTime` (whole seconds, `.000Z`) is not renewed by a stop and
//!   start, as EC2's is;
//! - `privateDnsName` and `placement.availabilityZone` are there, and
//!   `TagSpecification` with `ResourceType=volume` tags the root volume;
//! - private addresses in a subnet are handed out in order from `.4`, the
//!   same in every server: two moto servers give their first instances in
//!   a zone the same `privateDnsName`. An instance launched without a
//!   subnet gets a random address outside its subnet;
//! - it closes every connection after its answer (no keep-alive), and its
//!   `RequestID` is always `request-id`;
//! - it checks no signature: the region comes from the credential scope.

pub mod ec2;
pub mod kubelet;
pub mod proxy;
pub mod xml;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub use self::ec2::{Ec2, Ec2Error, ErrorDocument, Instance, Launch, Subnet, Volume};
pub use self::kubelet::{KubeletOptions, MotoKubelet, NodeNaming};
pub use self::proxy::{Answer, Fault, FaultProxy, Times};
use crate::testbed::supervisor::{ProcessSpec, Supervisor};

/// How long moto may take to answer its first request.
const READY_WITHIN: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("moto is not installed: {0}")]
    Install(String),
    #[error("starting moto: {0}")]
    Io(#[from] std::io::Error),
    #[error("moto did not answer within {READY_WITHIN:?} (log: {log})")]
    NotReady { log: String },
}

/// One moto server on `127.0.0.1`.
pub struct Moto {
    port: u16,
    dir: tempfile::TempDir,
    // Dropped last: kills the server.
    _supervisor: Supervisor,
}

impl Moto {
    /// Installs moto if needed, starts a server on a free port and waits
    /// until it answers.
    pub async fn start() -> Result<Self, Error> {
        let bin = bin_dir()?;
        let dir = tempfile::Builder::new().prefix("berth-moto-").tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let supervisor = Supervisor::new()?;
        let log = dir.path().join("moto.log");
        supervisor.spawn(ProcessSpec {
            name: "moto".into(),
            program: bin.join("moto_server"),
            args: vec![
                "-H".into(),
                "127.0.0.1".into(),
                "-p".into(),
                port.to_string(),
            ],
            log: log.clone(),
        })?;
        let moto = Self {
            port,
            dir,
            _supervisor: supervisor,
        };
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if moto
                .request("GET", "/moto-api/", None, "")
                .await
                .is_some_and(|(status, _)| status == 200)
            {
                return Ok(moto);
            }
            if Instant::now() > deadline || moto._supervisor.exited("moto").is_some() {
                return Err(Error::NotReady {
                    log: crate::testbed::tail(&log),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The endpoint URL to point an EC2 client at.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// An EC2 client of this server for `region`.
    pub fn client(&self, region: &str) -> Ec2 {
        Ec2::new(&self.endpoint(), region)
    }

    /// The server's log.
    pub fn log(&self) -> PathBuf {
        self.dir.path().join("moto.log")
    }

    /// An EC2 Query API call (`Action=…&Version=…&…`) in `region`, as an
    /// SDK would send it, with a syntactically valid signature (moto does
    /// not check signatures; it reads the region from the credential
    /// scope). Returns the HTTP status and the XML body.
    pub async fn ec2(&self, region: &str, form: &str) -> Option<(u16, String)> {
        let auth = format!(
            "AWS4-HMAC-SHA256 Credential=testing/20260101/{region}/ec2/aws4_request, \
             SignedHeaders=host;x-amz-date, Signature={}",
            "0".repeat(64)
        );
        self.request("POST", "/", Some(&auth), form).await
    }

    /// Forgets every resource (moto's `/moto-api/reset`).
    pub async fn reset(&self) -> bool {
        self.request("POST", "/moto-api/reset", None, "")
            .await
            .is_some_and(|(status, _)| status == 200)
    }

    async fn request(
        &self,
        method: &str,
        path: &str,
        auth: Option<&str>,
        body: &str,
    ) -> Option<(u16, String)> {
        let mut req = format!(
            "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1:{}\r\nX-Amz-Date: 20260101T000000Z\r\n\
             Content-Type: application/x-www-form-urlencoded; charset=utf-8\r\nContent-Length: {}\r\n",
            self.port,
            body.len()
        );
        if let Some(auth) = auth {
            req.push_str(&format!("Authorization: {auth}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(body);
        crate::testbed::http_exchange(self.port, &req).await
    }
}

/// moto's `bin` directory: `$BERTH_MOTO_BIN`, or what
/// `hack/moto/install.sh --bin-dir` installs or finds in its cache.
pub fn bin_dir() -> Result<PathBuf, Error> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| crate::testbed::cached_tool("BERTH_MOTO_BIN", "hack/moto/install.sh"))
        .clone()
        .map_err(Error::Install)
}
