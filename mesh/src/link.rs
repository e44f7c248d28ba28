//! The `Link` custom resource (`links.multicluster.strait.dev/v1alpha1`): one
//! per remote cluster whose exported Services this cluster mirrors. Shared by
//! the mirror controller (which reconciles it) and the CLI (which writes it).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::names::EXPORT_LABEL;

/// Finalizer the mirror controller puts on Links so their mirrors go with them.
pub const LINK_FINALIZER: &str = "multicluster.strait.dev/mirrors";

/// A link to a remote cluster whose exported Services are mirrored here.
#[derive(CustomResource, Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[kube(
    group = "multicluster.strait.dev",
    version = "v1alpha1",
    kind = "Link",
    namespaced,
    status = "LinkStatus",
    shortname = "lk",
    printcolumn = r#"{"name":"Cluster","type":"string","jsonPath":".spec.targetClusterName"}"#,
    printcolumn = r#"{"name":"Mirrored","type":"integer","jsonPath":".status.mirroredServices"}"#,
    printcolumn = r#"{"name":"Gateway","type":"string","jsonPath":".status.conditions[?(@.type==\"GatewayAlive\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct LinkSpec {
    /// Name of the remote cluster; mirrors are named `<service>-<targetClusterName>`.
    #[schemars(
        length(min = 1, max = 40),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub target_cluster_name: String,
    /// DNS domain of the remote cluster.
    #[serde(default = "default_domain")]
    #[schemars(length(min = 1, max = 253))]
    pub target_cluster_domain: String,
    /// Secret (same namespace) holding a kubeconfig for the remote API server under key `kubeconfig`.
    #[schemars(length(min = 1, max = 253))]
    pub cluster_credentials_secret: String,
    /// Addresses (IPs or hostnames) of the remote gateway.
    #[serde(default)]
    pub gateway_addresses: Vec<String>,
    /// Port of the remote gateway (QUIC on UDP, TLS on TCP).
    #[serde(default = "default_gateway_port")]
    #[schemars(range(min = 1, max = 65535), extend("format" = "int32"))]
    pub gateway_port: u16,
    /// SPIFFE ID the remote gateway must present.
    #[serde(default)]
    pub gateway_identity: String,
    /// How the gateway's health is probed.
    #[serde(default)]
    pub probe: ProbeSpec,
    /// Which remote Services to mirror. Default `strait.dev/exported=true`; an
    /// empty selector matches nothing.
    #[serde(default = "default_selector")]
    pub selector: LabelSelector,
    /// Labels not copied to mirrors; `prefix/*` matches a whole prefix.
    #[serde(default)]
    pub excluded_labels: Vec<String>,
    /// Annotations not copied to mirrors; `prefix/*` matches a whole prefix.
    #[serde(default)]
    pub excluded_annotations: Vec<String>,
    /// After the remote has been unreachable this long, its endpoints are marked not ready (e.g. "5m").
    #[serde(
        default,
        rename = "stalenessTTL",
        skip_serializing_if = "Option::is_none"
    )]
    pub staleness_ttl: Option<String>,
}

/// Gateway probe settings.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ProbeSpec {
    /// For an HTTPS probe (see `port`): the path to GET, expecting 200.
    #[serde(default = "default_probe_path")]
    pub path: String,
    /// Unset or the gateway port (the default): the probe opens a tunnel
    /// stream to the gateway's probe target, over QUIC falling back to TCP, so
    /// it measures the real path. Any other port (e.g. the admin port 4191):
    /// an HTTPS GET of `path` with mutual TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535), extend("format" = "int32"))]
    pub port: Option<u16>,
    /// Time between probes, e.g. "3s".
    #[serde(default = "default_probe_period")]
    pub period: String,
    /// Time a probe may take, e.g. "2s".
    #[serde(default = "default_probe_timeout")]
    pub timeout: String,
    /// Consecutive failures before the gateway counts as down.
    #[serde(default = "default_failure_threshold")]
    #[schemars(range(min = 1, max = 100), extend("format" = "int32"))]
    pub failure_threshold: u32,
}

impl Default for ProbeSpec {
    fn default() -> Self {
        Self {
            path: default_probe_path(),
            port: None,
            period: default_probe_period(),
            timeout: default_probe_timeout(),
            failure_threshold: default_failure_threshold(),
        }
    }
}

/// Observed state of a Link.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LinkStatus {
    /// CredentialsValid, RemoteReachable, GatewayAlive.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Number of Services mirrored from the remote cluster.
    #[serde(default)]
    #[schemars(extend("format" = "int64"))]
    pub mirrored_services: u32,
    /// Per-service state, for services that could not be mirrored.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<ServiceMirrorStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Latency of the gateway's recent successful probes (the real data path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_latency: Option<GatewayLatency>,
}

/// Percentiles over a window of the most recent successful gateway probes,
/// across the Link's gateway addresses. Refreshed at most every
/// [`GATEWAY_LATENCY_PUBLISH_INTERVAL_SECS`], so a steady link writes little.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GatewayLatency {
    /// Median probe latency, milliseconds.
    pub p50_ms: f64,
    /// 99th percentile probe latency, milliseconds.
    pub p99_ms: f64,
    /// How many probes the percentiles are taken over.
    #[schemars(extend("format" = "int64"))]
    pub samples: u32,
}

/// How often, at most, a Link's `status.gatewayLatency` is rewritten.
pub const GATEWAY_LATENCY_PUBLISH_INTERVAL_SECS: u64 = 30;
/// Name of the Lease the mirror controller renews in its namespace while it runs.
pub const MIRROR_HEARTBEAT_LEASE: &str = "strait-mirror";
/// The ConfigMap (key `ca.crt`) with a cluster's trust anchors, in [`SYSTEM_NAMESPACE`](crate::names::SYSTEM_NAMESPACE).
pub const TRUST_ANCHORS_CONFIGMAP: &str = "strait-trust-anchors";

/// Why one remote Service is (not) mirrored.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "camelCase")]
pub struct ServiceMirrorStatus {
    pub namespace: String,
    pub name: String,
    pub mirrored: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

fn default_domain() -> String {
    "cluster.local".into()
}
fn default_gateway_port() -> u16 {
    4143
}
fn default_probe_path() -> String {
    "/ready".into()
}
fn default_probe_period() -> String {
    "3s".into()
}
fn default_probe_timeout() -> String {
    "2s".into()
}
fn default_failure_threshold() -> u32 {
    3
}
/// `strait.dev/exported=true`.
pub fn default_selector() -> LabelSelector {
    LabelSelector {
        match_labels: Some(BTreeMap::from([(
            EXPORT_LABEL.to_string(),
            "true".to_string(),
        )])),
        match_expressions: None,
    }
}

/// Whether `key` is excluded by `patterns` (exact keys, or `prefix/*`).
pub fn is_excluded(key: &str, patterns: &[String]) -> bool {
    patterns.iter().any(|p| match p.strip_suffix("/*") {
        Some(prefix) => key
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/')),
        None => p == key,
    })
}

/// A label selector as the API's `labelSelector` query string; `None` when it
/// matches nothing (an empty selector, by Strait's rule: never mirror everything by accident).
pub fn selector_query(selector: &LabelSelector) -> Option<String> {
    let mut parts = Vec::new();
    for (k, v) in selector.match_labels.iter().flatten() {
        parts.push(format!("{k}={v}"));
    }
    for expr in selector.match_expressions.iter().flatten() {
        let values = expr.values.clone().unwrap_or_default().join(",");
        parts.push(match expr.operator.as_str() {
            "In" => format!("{} in ({values})", expr.key),
            "NotIn" => format!("{} notin ({values})", expr.key),
            "Exists" => expr.key.clone(),
            "DoesNotExist" => format!("!{}", expr.key),
            _ => return None,
        });
    }
    (!parts.is_empty()).then(|| parts.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    #[test]
    fn crd_has_schema_status_and_defaults() {
        let crd = Link::crd();
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some("links.multicluster.strait.dev")
        );
        let json = serde_json::to_string(&crd).unwrap();
        assert!(
            json.contains("targetClusterName") && json.contains("\"status\""),
            "{json}"
        );
        // The API server warns about formats it does not know (schemars
        // writes uint16/uint32 for unsigned fields): only int32/int64 here.
        assert!(!json.contains("\"format\":\"uint"), "{json}");
    }

    #[test]
    fn exclusion_patterns() {
        let pats = vec!["team".to_string(), "internal.example.com/*".to_string()];
        assert!(is_excluded("team", &pats));
        assert!(is_excluded("internal.example.com/owner", &pats));
        assert!(!is_excluded("internal.example.com", &pats));
        assert!(!is_excluded("internal.example.community/x", &pats));
        assert!(!is_excluded("app", &pats));
    }

    #[test]
    fn selectors_become_queries_and_empty_matches_nothing() {
        assert_eq!(
            selector_query(&default_selector()).as_deref(),
            Some("strait.dev/exported=true")
        );
        assert_eq!(selector_query(&LabelSelector::default()), None);
        let spec: LinkSpec = serde_json::from_value(serde_json::json!({
            "targetClusterName": "west", "clusterCredentialsSecret": "s",
        }))
        .unwrap();
        assert_eq!(spec.target_cluster_domain, "cluster.local");
        assert_eq!(spec.gateway_port, 4143);
        assert_eq!(spec.probe.failure_threshold, 3);
        assert_eq!(
            selector_query(&spec.selector).as_deref(),
            Some("strait.dev/exported=true")
        );
    }
}
