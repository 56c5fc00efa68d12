//! The API server's own `/metrics`: its writes served, by kind, and when
//! the test bed has settled; and the `berth_` counters of the controller.

use super::*;

/// The sum of every sample of the metric family `name` in a Prometheus text
/// exposition.
pub fn metric_sum(body: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for (sample, value) in samples(body) {
        let family = sample.split('{').next().unwrap_or(sample);
        if family == name {
            *found.get_or_insert(0.0) += value;
        }
    }
    found
}

/// The API server's mutating requests so far (`apiserver_request_total`),
/// Lease renewals left out.
pub fn writes_served(body: &str) -> f64 {
    writes_by_kind(body)
        .into_iter()
        .filter(|(kind, _)| !kind.ends_with(" leases"))
        .map(|(_, n)| n)
        .sum()
}

/// The API server's mutating requests so far, every client's, by `VERB
/// resource[/subresource]` (from `apiserver_request_total`, over every
/// response code and API version).
pub fn writes_by_kind(body: &str) -> BTreeMap<String, f64> {
    let label = |sample: &str, name: &str| -> Option<String> {
        let start = sample.find(&format!("{name}=\""))? + name.len() + 2;
        let len = sample[start..].find('"')?;
        Some(sample[start..start + len].to_owned())
    };
    let mut out = BTreeMap::new();
    for (sample, value) in samples(body).filter(|(s, _)| s.starts_with("apiserver_request_total{"))
    {
        let Some(verb) = label(sample, "verb") else {
            continue;
        };
        if !["POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION"].contains(&verb.as_str()) {
            continue;
        }
        let resource = label(sample, "resource").unwrap_or_default();
        let kind = match label(sample, "subresource").filter(|s| !s.is_empty()) {
            Some(sub) => format!("{verb} {resource}/{sub}"),
            None => format!("{verb} {resource}"),
        };
        *out.entry(kind).or_insert(0.0) += value;
    }
    out
}

/// Each kind's count in `after` less its count in `before`; kinds that did
/// not change are left out.
pub fn served_between(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter_map(|(kind, n)| {
            let d = n - before.get(kind).copied().unwrap_or(0.0);
            (d > 0.0).then(|| (kind.clone(), d.round() as u64))
        })
        .collect()
}

/// Waits until the API server serves fewer than
/// [`SETTLED_WRITES_PER_SECOND`] writes; returns how long that took.
pub(in crate::bench) async fn settle(admin: &Client) -> anyhow::Result<f64> {
    let served = || async { anyhow::Ok(writes_served(&apiserver_metrics(admin).await?)) };
    let started = Instant::now();
    let mut before = served().await?;
    loop {
        tokio::time::sleep(SETTLE_WINDOW).await;
        let now = served().await?;
        let rate = (now - before) / SETTLE_WINDOW.as_secs_f64();
        if rate < SETTLED_WRITES_PER_SECOND {
            return Ok(started.elapsed().as_secs_f64());
        }
        if started.elapsed() > STEP_TIMEOUT {
            anyhow::bail!(
                "the test bed still served {rate:.0} writes a second {STEP_TIMEOUT:?} after populating"
            );
        }
        eprintln!("scale: the test bed is still busy: {rate:.0} writes a second");
        before = now;
    }
}

/// The API server's own `/metrics`.
pub(super) async fn apiserver_metrics(admin: &Client) -> anyhow::Result<String> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    Ok(admin.request_text(req).await?)
}

/// Every `berth_` sample except histogram buckets.
pub fn counters(body: &str) -> BTreeMap<String, f64> {
    samples(body)
        .filter(|(s, _)| s.starts_with("berth_") && !s.contains("_bucket"))
        .map(|(s, v)| (s.to_string(), v))
        .collect()
}

pub(super) fn samples(body: &str) -> impl Iterator<Item = (&str, f64)> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (sample, value) = l.rsplit_once(' ')?;
            Some((sample, value.parse().ok()?))
        })
}
