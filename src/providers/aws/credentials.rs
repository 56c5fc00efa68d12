//! Whose credentials sign berth's EC2 calls: the Secret a class names in
//! `secretRef`, or else the standard AWS chain (environment, web identity /
//! IRSA, ECS and EC2 instance roles, profiles) from AWS's own `aws-config`.
//!
//! Credentials are kept until five minutes before they expire, so that a
//! web-identity or instance-role chain is not asked on every call, and a
//! Secret is read at most once a minute. Keys and tokens never reach a log,
//! an Event or a condition: errors name the Secret and the key, never a
//! value.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use aws_credential_types::Credentials;
use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use tokio::sync::OnceCell;

use crate::api::SecretReference;
use crate::providers::ProviderError;

/// The keys a credentials Secret holds (the environment variables' names,
/// which operators already know).
pub(crate) const ACCESS_KEY_ID: &str = "AWS_ACCESS_KEY_ID";
pub(crate) const SECRET_ACCESS_KEY: &str = "AWS_SECRET_ACCESS_KEY";
pub(crate) const SESSION_TOKEN: &str = "AWS_SESSION_TOKEN";

/// How long a Secret's credentials are used before the Secret is read
/// again (a rotated key is picked up within this).
const SECRET_TTL: Duration = Duration::from_secs(60);
/// Credentials that expire sooner than this are refreshed.
const EXPIRY_MARGIN: Duration = Duration::from_secs(300);

pub(crate) struct CredentialSource {
    kube: kube::Client,
    chain_provider: OnceCell<Option<SharedCredentialsProvider>>,
    from_chain: Mutex<Option<Credentials>>,
    from_secrets: Mutex<HashMap<(String, String), (Credentials, Instant)>>,
}

impl CredentialSource {
    pub(crate) fn new(kube: kube::Client) -> Self {
        Self {
            kube,
            chain_provider: OnceCell::new(),
            from_chain: Mutex::new(None),
            from_secrets: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) async fn get(
        &self,
        secret: Option<&SecretReference>,
    ) -> Result<Credentials, ProviderError> {
        match secret {
            Some(r) => self.secret(r).await,
            None => self.chain().await,
        }
    }

    /// Forgets what is kept, after EC2 refused the credentials.
    pub(crate) fn forget(&self, secret: Option<&SecretReference>) {
        match secret {
            Some(r) => {
                if let Ok(mut m) = self.from_secrets.lock() {
                    m.remove(&(r.namespace.clone(), r.name.clone()));
                }
            }
            None => {
                if let Ok(mut c) = self.from_chain.lock() {
                    *c = None;
                }
            }
        }
    }

    async fn secret(&self, r: &SecretReference) -> Result<Credentials, ProviderError> {
        let key = (r.namespace.clone(), r.name.clone());
        if let Ok(m) = self.from_secrets.lock()
            && let Some((c, read)) = m.get(&key)
            && read.elapsed() < SECRET_TTL
            && fresh(c, SystemTime::now())
        {
            return Ok(c.clone());
        }
        let where_ = format!("secretRef {}/{}", r.namespace, r.name);
        let secret = Api::<Secret>::namespaced(self.kube.clone(), &r.namespace)
            .get_opt(&r.name)
            .await
            .map_err(|e| ProviderError::Transient(format!("{where_}: {e}")))?
            .ok_or_else(|| ProviderError::Unauthorized(format!("{where_}: no such Secret")))?;
        let c = credentials_of(&secret)
            .map_err(|missing| ProviderError::Unauthorized(format!("{where_}: {missing}")))?;
        if let Ok(mut m) = self.from_secrets.lock() {
            m.insert(key, (c.clone(), Instant::now()));
        }
        Ok(c)
    }

    async fn chain(&self) -> Result<Credentials, ProviderError> {
        if let Ok(c) = self.from_chain.lock()
            && let Some(c) = c.as_ref()
            && fresh(c, SystemTime::now())
        {
            return Ok(c.clone());
        }
        let chain = self
            .chain_provider
            .get_or_init(|| async {
                let http = aws_smithy_http_client::Builder::new()
                    .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                        aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
                    ))
                    .build_https();
                aws_config::defaults(aws_config::BehaviorVersion::latest())
                    .http_client(http)
                    .load()
                    .await
                    .credentials_provider()
            })
            .await;
        let Some(chain) = chain else {
            return Err(ProviderError::Unauthorized(
                "no AWS credentials: the class has no secretRef and the AWS chain has no provider"
                    .into(),
            ));
        };
        let c = chain
            .provide_credentials()
            .await
            .map_err(|e| chain_error(&e))?;
        if let Ok(mut kept) = self.from_chain.lock() {
            *kept = Some(c.clone());
        }
        Ok(c)
    }
}

/// What a failure of the AWS credential chain means: no credentials, or a
/// configuration that cannot give any, is for an operator to fix
/// (unauthorized, asked again slowly); a provider that timed out or failed
/// (the instance metadata service or STS slow or unavailable, a 5xx) may
/// pass by itself, and is tried again with backoff.
fn chain_error(e: &aws_credential_types::provider::error::CredentialsError) -> ProviderError {
    use aws_credential_types::provider::error::CredentialsError as E;
    let what = "AWS credentials from the environment, web identity (IRSA) or instance role \
                (the class has no secretRef)";
    match e {
        E::CredentialsNotLoaded(_) | E::InvalidConfiguration(_) => {
            ProviderError::Unauthorized(format!("no {what}: {e}"))
        }
        _ => {
            // The cause, not only the variant's name.
            let mut why = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(s) = source {
                why.push_str(&format!(": {s}"));
                source = s.source();
            }
            ProviderError::Transient(format!(
                "could not load the {what} now, tried again with backoff: {why}"
            ))
        }
    }
}

/// Whether credentials are good for a while yet.
fn fresh(c: &Credentials, now: SystemTime) -> bool {
    c.expiry().is_none_or(|e| e > now + EXPIRY_MARGIN)
}

/// The credentials a Secret holds, or which key is missing.
pub(crate) fn credentials_of(s: &Secret) -> Result<Credentials, String> {
    let value = |k: &str| -> Option<String> {
        let data = s.data.as_ref()?.get(k)?;
        let v = String::from_utf8(data.0.clone()).ok()?;
        let v = v.trim().to_string();
        (!v.is_empty()).then_some(v)
    };
    let id = value(ACCESS_KEY_ID).ok_or_else(|| format!("no {ACCESS_KEY_ID} key"))?;
    let secret = value(SECRET_ACCESS_KEY).ok_or_else(|| format!("no {SECRET_ACCESS_KEY} key"))?;
    Ok(Credentials::new(
        id,
        secret,
        value(SESSION_TOKEN),
        None,
        "berth-secret-ref",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use std::collections::BTreeMap;

    fn secret(pairs: &[(&str, &str)]) -> Secret {
        Secret {
            data: Some(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn a_secret_gives_keys_and_an_optional_token_and_names_what_is_missing() {
        let c = credentials_of(&secret(&[
            (ACCESS_KEY_ID, "AKID\n"),
            (SECRET_ACCESS_KEY, "s3cr3t"),
        ]))
        .expect("credentials");
        assert_eq!(c.access_key_id(), "AKID");
        assert_eq!(c.session_token(), None);
        let err = credentials_of(&secret(&[(ACCESS_KEY_ID, "AKID")])).expect_err("incomplete");
        assert_eq!(err, "no AWS_SECRET_ACCESS_KEY key");
        let err = credentials_of(&secret(&[(ACCESS_KEY_ID, " "), (SECRET_ACCESS_KEY, "s")]))
            .expect_err("blank");
        assert_eq!(err, "no AWS_ACCESS_KEY_ID key");
        // The Debug form of credentials hides the secret.
        let c = credentials_of(&secret(&[
            (ACCESS_KEY_ID, "AKID"),
            (SECRET_ACCESS_KEY, "s3cr3t"),
            (SESSION_TOKEN, "t0ken"),
        ]))
        .expect("credentials");
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cr3t") && !shown.contains("t0ken"),
            "{shown}"
        );
    }

    #[test]
    fn credentials_are_refreshed_before_they_expire() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let lasting = Credentials::new("a", "b", None, None, "t");
        assert!(fresh(&lasting, now));
        let soon = Credentials::new("a", "b", None, Some(now + Duration::from_secs(60)), "t");
        assert!(!fresh(&soon, now));
        let later = Credentials::new("a", "b", None, Some(now + Duration::from_secs(3600)), "t");
        assert!(fresh(&later, now));
    }

    #[test]
    fn a_chain_that_fails_for_now_is_transient_and_one_without_credentials_is_not() {
        use aws_credential_types::provider::error::CredentialsError;
        assert!(matches!(
            chain_error(&CredentialsError::provider_timed_out(
                std::time::Duration::from_secs(5)
            )),
            ProviderError::Transient(_)
        ));
        assert!(matches!(
            chain_error(&CredentialsError::provider_error("STS answered 503")),
            ProviderError::Transient(m) if m.contains("503")
        ));
        assert!(matches!(
            chain_error(&CredentialsError::not_loaded("no source")),
            ProviderError::Unauthorized(_)
        ));
        assert!(matches!(
            chain_error(&CredentialsError::invalid_configuration("a loop of roles")),
            ProviderError::Unauthorized(_)
        ));
    }
}
