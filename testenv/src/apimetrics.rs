//! What a real API server says it served: `apiserver_request_total` from its
//! own `/metrics`, summed by resource and verb. Benchmarks and scale tests
//! count the requests a component adds with it (before, after, [`minus`]).

use std::collections::BTreeMap;

use anyhow::Context;

/// Requests served so far, keyed `"resource[/subresource] VERB"` (for
/// example `"services APPLY"`, `"links/status PATCH"`, `"endpointslices WATCH"`).
pub type Requests = BTreeMap<String, f64>;

/// The verbs that change objects.
pub const WRITE_VERBS: &[&str] = &["POST", "PUT", "PATCH", "APPLY", "DELETE"];

/// The API server's request counters now.
pub async fn requests(client: &kube::Client) -> anyhow::Result<Requests> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = client
        .request_text(request)
        .await
        .context("reading the API server's /metrics")?;
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .context("parsing the API server's /metrics")?;
    let mut out = Requests::new();
    for s in scrape
        .samples
        .iter()
        .filter(|s| s.metric == "apiserver_request_total")
    {
        let (prometheus_parse::Value::Counter(n) | prometheus_parse::Value::Untyped(n)) = s.value
        else {
            continue;
        };
        let label = |k: &str| s.labels.get(k).unwrap_or("");
        let resource = match label("subresource") {
            "" => label("resource").to_string(),
            sub => format!("{}/{sub}", label("resource")),
        };
        *out.entry(format!("{resource} {}", label("verb")))
            .or_default() += n;
    }
    Ok(out)
}

/// What was served between `before` and `after` (only what grew).
pub fn minus(after: &Requests, before: &Requests) -> Requests {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

/// The requests of `verb` among `requests`.
pub fn verb(requests: &Requests, verb: &str) -> Requests {
    requests
        .iter()
        .filter(|(k, _)| k.rsplit_once(' ').is_some_and(|(_, v)| v == verb))
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

/// The requests that change objects among `requests`.
pub fn writes(requests: &Requests) -> Requests {
    WRITE_VERBS.iter().flat_map(|v| verb(requests, v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_told_apart_by_verb_and_only_growth_counts() {
        let before: Requests = [
            ("services APPLY".into(), 2.0),
            ("services LIST".into(), 5.0),
        ]
        .into();
        let after: Requests = [
            ("services APPLY".into(), 7.0),
            ("services LIST".into(), 5.0),
            ("links/status PATCH".into(), 1.0),
        ]
        .into();
        let grew = minus(&after, &before);
        assert_eq!(grew.len(), 2, "{grew:?}");
        assert_eq!(grew["services APPLY"], 5.0);
        assert_eq!(writes(&grew).values().sum::<f64>(), 6.0);
        assert!(verb(&grew, "LIST").is_empty());
    }
}
