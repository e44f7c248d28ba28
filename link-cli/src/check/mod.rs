//! `strait check`: is this cluster's Strait healthy, and are its links?
//!
//! Each check is a small function that returns [`CheckResult`]s; [`run_all`]
//! calls them in order, [`render`] prints ✓/‼/× lines with a hint for every
//! failure. `--wait` repeats the whole round until everything passes or the
//! time is up. Checks that only make sense once another passed (a Link's
//! remote when its credentials load) are skipped, not failed twice.

mod links;
pub(crate) use links::bearer_token;
pub(crate) mod local;
pub mod pure;

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::link::{client_for, load_kubeconfig};
use pure::Level;

pub use strait_mesh::names::SYSTEM_NAMESPACE;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// Kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the cluster to check (the one holding the Links and mirrors).
    #[arg(long)]
    pub context: Option<String>,
    /// Retry until every check passes or this much time has gone (e.g. "2m").
    #[arg(long, value_parser = humantime::parse_duration)]
    pub wait: Option<Duration>,
    /// Output: text (✓/× lines) or json (an array of {check, ok, warning, message, hint}).
    #[arg(short, long, value_enum, default_value = "text")]
    pub output: Output,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Text,
    Json,
}

/// Reads the object `name` for a check. When it does not exist, `missing`
/// is reported; when it cannot be read, a failure naming `what` (e.g.
/// "Secret ns/name") with `unreadable_hint`. Either way `None` comes back
/// and the caller's check stops there.
pub(crate) async fn fetch<K>(
    api: &kube::Api<K>,
    name: &str,
    what: &str,
    missing: CheckResult,
    unreadable_hint: &str,
    out: &mut Vec<CheckResult>,
) -> Option<K>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.get_opt(name).await {
        Ok(Some(object)) => Some(object),
        Ok(None) => {
            out.push(missing);
            None
        }
        Err(e) => {
            out.push(CheckResult::fail(
                missing.check,
                format!("cannot read {what}: {e}"),
                unreadable_hint,
            ));
            None
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CheckResult {
    pub check: String,
    /// False only for failures; a warning is ok with `warning` set.
    pub ok: bool,
    pub warning: bool,
    pub message: String,
    /// What to do about it (always given for failures and warnings).
    pub hint: Option<String>,
}

impl CheckResult {
    pub fn pass(check: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            check: check.into(),
            ok: true,
            warning: false,
            message: message.into(),
            hint: None,
        }
    }
    pub fn fail(
        check: impl Into<String>,
        message: impl Into<String>,
        hint: impl Into<String>,
    ) -> Self {
        Self {
            check: check.into(),
            ok: false,
            warning: false,
            message: message.into(),
            hint: Some(hint.into()),
        }
    }
    pub fn warn(
        check: impl Into<String>,
        message: impl Into<String>,
        hint: impl Into<String>,
    ) -> Self {
        Self {
            check: check.into(),
            ok: true,
            warning: true,
            message: message.into(),
            hint: Some(hint.into()),
        }
    }
    /// A result at `level`; the hint is dropped when it passes.
    pub fn at(
        level: Level,
        check: impl Into<String>,
        message: impl Into<String>,
        hint: impl Into<String>,
    ) -> Self {
        match level {
            Level::Ok => Self::pass(check, message),
            Level::Warning => Self::warn(check, message, hint),
            Level::Fail => Self::fail(check, message, hint),
        }
    }
}

/// ✓ / ‼ / × lines, hints indented under their line, and a summary.
pub fn render(results: &[CheckResult]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    for r in results {
        let mark = match (r.ok, r.warning) {
            (false, _) => "×",
            (true, true) => "‼",
            (true, false) => "✓",
        };
        let _ = writeln!(out, "{mark} {}: {}", r.check, r.message);
        if (!r.ok || r.warning)
            && let Some(hint) = &r.hint
        {
            let _ = writeln!(out, "    hint: {hint}");
        }
    }
    let failed = results.iter().filter(|r| !r.ok).count();
    let warned = results.iter().filter(|r| r.ok && r.warning).count();
    let _ = match failed {
        0 => writeln!(
            out,
            "\nStatus check results are ✓ ({} checks, {warned} warnings)",
            results.len()
        ),
        n => writeln!(
            out,
            "\nStatus check results are × ({n} of {} checks failed, {warned} warnings)",
            results.len()
        ),
    };
    out
}

/// Every check, in reading order.
pub async fn run_all(client: &kube::Client) -> Vec<CheckResult> {
    let mut results = Vec::new();
    let crd_ok = local::crd(client, &mut results).await;
    let anchors = local::trust_anchors(client, &mut results).await;
    local::issuer(client, anchors.as_deref(), &mut results).await;
    local::node_proxies(client, &mut results).await;
    if !crd_ok {
        return results;
    }
    let links = links::check_links(client, anchors.as_deref(), &mut results).await;
    local::mirror_controller(client, !links.is_empty(), &mut results).await;
    local::mirror_endpoints(client, &mut results).await;
    local::orphan_mirrors(client, &links, &mut results).await;
    results
}

pub async fn check(args: CheckArgs) -> anyhow::Result<bool> {
    let kubeconfig = load_kubeconfig(&args.kubeconfig)?;
    let (client, _) = client_for(&kubeconfig, &args.context).await?;
    let deadline = args.wait.map(|w| tokio::time::Instant::now() + w);
    let results = loop {
        let results = run_all(&client).await;
        let failing: Vec<&CheckResult> = results.iter().filter(|r| !r.ok).collect();
        match deadline {
            Some(d) if !failing.is_empty() && tokio::time::Instant::now() < d => {
                eprintln!(
                    "waiting: {} check(s) failing, first: {}: {}",
                    failing.len(),
                    failing[0].check,
                    failing[0].message
                );
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            _ => break results,
        }
    };
    match args.output {
        Output::Text => print!("{}", render(&results)),
        Output::Json => println!("{}", serde_json::to_string_pretty(&results)?),
    }
    Ok(results.iter().all(|r| r.ok))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendering_marks_each_line_and_hints_failures_only() {
        let results = vec![
            CheckResult::pass("Link CRD", "installed, serves v1alpha1"),
            CheckResult::warn("link west: credentials", "expires in 1h", "re-link"),
            CheckResult::fail("link west: gateway", "down", "start the gateway"),
        ];
        let text = render(&results);
        assert_eq!(
            text,
            "✓ Link CRD: installed, serves v1alpha1\n\
             ‼ link west: credentials: expires in 1h\n    hint: re-link\n\
             × link west: gateway: down\n    hint: start the gateway\n\
             \nStatus check results are × (1 of 3 checks failed, 1 warnings)\n"
        );
        let json = serde_json::to_value(&results).unwrap();
        assert_eq!(json[2]["check"], "link west: gateway");
        assert_eq!(json[2]["ok"], false);
        assert_eq!(json[2]["hint"], "start the gateway");
        assert_eq!(json[0]["hint"], serde_json::Value::Null);
        assert!(render(&results[..1]).ends_with("are ✓ (1 checks, 0 warnings)\n"));
    }
}
