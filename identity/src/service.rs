//! The signing decision: parse, authenticate, authorise, sign. Every refusal
//! carries a stable reason (for metrics and clients) and a message that says
//! what to fix.

use std::time::Duration;

use kube::Client;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::ca::LeafSigner;
use strait_mesh::identity::protocol::{CertificateResponse, ErrorResponse, parse_request};

use crate::authn::{self, AuthError};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IssuanceLabels {
    result: &'static str,
    reason: &'static str,
}

/// Issuer metrics: issuances by result and reason, latency, issuer expiry.
#[derive(Clone, Debug)]
pub struct IssuerMetrics {
    issuances: Family<IssuanceLabels, Counter>,
    latency: Histogram,
    issuer_expiry: Gauge,
}

impl Default for IssuerMetrics {
    fn default() -> Self {
        Self {
            issuances: Family::default(),
            latency: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            issuer_expiry: Gauge::default(),
        }
    }
}

impl IssuerMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "identity_issuance",
            "Certificate requests by result (success, failure) and failure reason",
            self.issuances.clone(),
        );
        registry.register(
            "identity_issuance_duration_seconds",
            "Time to answer a certificate request, including TokenReview",
            self.latency.clone(),
        );
        registry.register(
            "identity_issuer_cert_expiration_timestamp_seconds",
            "Expiry of this issuer's own (intermediate) certificate, seconds since the Unix epoch",
            self.issuer_expiry.clone(),
        );
    }
}

/// A refused request.
#[derive(Debug)]
pub struct Refusal {
    pub status: u16,
    pub body: ErrorResponse,
}

impl Refusal {
    fn new(status: u16, reason: &'static str, message: String) -> Self {
        Self {
            status,
            body: ErrorResponse {
                reason: reason.to_string(),
                message,
            },
        }
    }
}

impl From<AuthError> for Refusal {
    fn from(e: AuthError) -> Self {
        Refusal::new(e.status(), e.reason(), e.to_string())
    }
}

/// Settings of the issuer.
#[derive(Debug)]
pub struct IssuerSettings {
    pub trust_domain: String,
    pub leaf_validity: Duration,
    /// ServiceAccounts (namespace, name) of node proxies, which may ask for the
    /// identity of pods on their own node.
    pub node_agents: Vec<(String, String)>,
    /// Namespaces whose ServiceAccounts are never certified: others hold
    /// their tokens (the link namespace's `strait-link-<cluster>` accounts).
    pub refused_namespaces: Vec<String>,
    /// ServiceAccounts (namespace, name) certified although their namespace
    /// is refused: the mirror controller, which probes gateways as itself.
    pub refusal_exceptions: Vec<(String, String)>,
}

impl IssuerSettings {
    /// Whether the identity of `namespace/service_account` may be certified.
    pub fn may_certify(&self, namespace: &str, service_account: &str) -> Result<(), AuthError> {
        let refused = self.refused_namespaces.iter().any(|ns| ns == namespace);
        let excepted = self
            .refusal_exceptions
            .iter()
            .any(|(ns, sa)| ns == namespace && sa == service_account);
        if refused && !excepted {
            return Err(AuthError::RefusedNamespace {
                namespace: namespace.into(),
                service_account: service_account.into(),
            });
        }
        Ok(())
    }
}

/// The issuer: holds the signing key, never hands it out.
pub struct IssuerService {
    /// Swapped whole when the issuer Secret changes (a rotation re-issues it).
    signer: arc_swap::ArcSwap<LeafSigner>,
    settings: IssuerSettings,
    client: Client,
    metrics: IssuerMetrics,
}

impl std::fmt::Debug for IssuerService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuerService")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl IssuerService {
    pub fn new(
        signer: LeafSigner,
        settings: IssuerSettings,
        client: Client,
        metrics: IssuerMetrics,
        issuer_not_after: i64,
    ) -> Self {
        metrics.issuer_expiry.set(issuer_not_after);
        Self {
            signer: arc_swap::ArcSwap::from_pointee(signer),
            settings,
            client,
            metrics,
        }
    }

    /// The issuer signing now.
    pub fn signer(&self) -> std::sync::Arc<LeafSigner> {
        self.signer.load_full()
    }

    /// Signs with `signer` from now on (checked by the caller: same trust domain).
    pub fn replace_signer(&self, signer: LeafSigner, issuer_not_after: i64) {
        self.metrics.issuer_expiry.set(issuer_not_after);
        self.signer.store(std::sync::Arc::new(signer));
    }

    pub fn trust_domain(&self) -> &str {
        &self.settings.trust_domain
    }

    /// Handles one request: `authorization` is the Authorization header value.
    pub async fn handle(
        &self,
        authorization: Option<&str>,
        body: &[u8],
    ) -> Result<CertificateResponse, Refusal> {
        let timer = std::time::Instant::now();
        let result = self.decide(authorization, body).await;
        self.metrics.latency.observe(timer.elapsed().as_secs_f64());
        let labels = match &result {
            Ok(_) => IssuanceLabels {
                result: "success",
                reason: "",
            },
            Err(r) => IssuanceLabels {
                result: "failure",
                reason: static_reason(&r.body.reason),
            },
        };
        self.metrics.issuances.get_or_create(&labels).inc();
        match &result {
            Ok(resp) => {
                tracing::info!(identity = %resp.identity, expires_at = resp.expires_at, "issued")
            }
            // The message names the caller and the reason, never the token.
            Err(r) => {
                tracing::warn!(status = r.status, reason = %r.body.reason, "refused: {}", r.body.message)
            }
        }
        result
    }

    async fn decide(
        &self,
        authorization: Option<&str>,
        body: &[u8],
    ) -> Result<CertificateResponse, Refusal> {
        let request =
            parse_request(body).map_err(|e| Refusal::new(400, e.reason(), e.to_string()))?;
        let token = authorization
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(AuthError::MissingToken)?;
        let caller = authn::authenticate(&self.client, token).await?;
        let (namespace, service_account) = match &request.pod {
            None => (caller.namespace.clone(), caller.service_account.clone()),
            Some(pod) => {
                let is_agent = self
                    .settings
                    .node_agents
                    .iter()
                    .any(|(ns, sa)| *ns == caller.namespace && *sa == caller.service_account);
                if !is_agent {
                    return Err(AuthError::NotNodeAgent {
                        caller: format!("{}/{}", caller.namespace, caller.service_account),
                    }
                    .into());
                }
                authn::authorize_pod(&self.client, &caller, pod).await?
            }
        };
        // Whichever way it was named (own token, or a node proxy for its pod).
        self.settings.may_certify(&namespace, &service_account)?;
        let id = SpiffeId::new(&self.settings.trust_domain, &namespace, &service_account)
            .map_err(|e| Refusal::new(400, "bad_identity", e.to_string()))?;
        // One signer for the leaf and the chain sent with it, even mid-rotation.
        let signer = self.signer();
        let leaf = signer
            .sign(&request.csr.public_key, &id, self.settings.leaf_validity)
            .map_err(|e| Refusal::new(500, "signing_failed", e.to_string()))?;
        Ok(CertificateResponse {
            identity: id,
            certificate: leaf.pem,
            chain: signer.issuer_pem().to_string(),
            expires_at: leaf.not_after,
        })
    }
}

/// Metric labels must be 'static; map known reasons, bucket the rest.
fn static_reason(reason: &str) -> &'static str {
    const KNOWN: &[&str] = &[
        "request_too_large",
        "bad_request",
        "bad_csr",
        "bad_pod_ref",
        "missing_token",
        "unauthenticated",
        "audience_not_confirmed",
        "not_service_account",
        "refused_namespace",
        "token_review_error",
        "not_node_agent",
        "caller_node_unknown",
        "pod_not_found",
        "wrong_node",
        "pod_lookup_error",
        "bad_identity",
        "signing_failed",
    ];
    KNOWN
        .iter()
        .find(|k| **k == reason)
        .copied()
        .unwrap_or("other")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_namespaces_are_refused_except_named_accounts() {
        let settings = IssuerSettings {
            trust_domain: "cluster.local".into(),
            leaf_validity: Duration::from_secs(3600),
            node_agents: Vec::new(),
            refused_namespaces: vec!["strait-multicluster".into()],
            refusal_exceptions: vec![("strait-multicluster".into(), "strait-mirror".into())],
        };
        let e = settings
            .may_certify("strait-multicluster", "strait-link-east")
            .unwrap_err();
        assert_eq!((e.reason(), e.status()), ("refused_namespace", 403));
        assert!(
            e.to_string()
                .contains("strait-multicluster/strait-link-east")
                && e.to_string().contains("another namespace"),
            "{e}"
        );
        assert!(
            settings
                .may_certify("strait-multicluster", "strait-mirror")
                .is_ok()
        );
        assert!(settings.may_certify("shop", "strait-link-east").is_ok());
        assert!(settings.may_certify("shop", "strait-mirror").is_ok());
    }

    #[test]
    fn every_refusal_reason_is_a_known_metric_label() {
        for reason in ["refused_namespace", "audience_not_confirmed"] {
            assert_eq!(static_reason(reason), reason);
        }
    }
}
