//! Why the gateway refuses a stream: each refusal's status on the wire, its
//! `reason` label on `gateway_denied_total`, and a message that says what to
//! change.

use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::tls::TlsError;
use strait_mesh::tunnel::ResponseStatus;
use strait_mesh::tunnel::client::TunnelError;

/// A Service's namespace and name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceName {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ServiceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(
        "{peer} may not speak for {claimed}: only node proxies may, and only for callers of their own trust domain"
    )]
    SourceClaim { peer: SpiffeId, claimed: SpiffeId },
    #[error("a gateway delivers to exported Services by name, not to pods")]
    NotAService,
    #[error("no Service {fqdn}:{port} in cluster {cluster}")]
    UnknownService {
        fqdn: String,
        port: u16,
        cluster: String,
    },
    #[error(
        "Service {service} is not exported from cluster {cluster} (label it strait.dev/exported=true)"
    )]
    NotExported {
        service: ServiceName,
        cluster: String,
    },
    #[error("{caller} is not allowed to call {service} (strait.dev/allowed-identities)")]
    Policy {
        caller: SpiffeId,
        service: ServiceName,
    },
    #[error("Service {service} has no ready pods")]
    NoEndpoints { service: ServiceName },
    #[error("{0}")]
    Config(#[from] TlsError),
    #[error("{0}")]
    Upstream(#[from] TunnelError),
}

impl Refusal {
    /// The tunnel response status the caller receives.
    pub fn status(&self) -> ResponseStatus {
        match self {
            Refusal::SourceClaim { .. } | Refusal::NotExported { .. } | Refusal::Policy { .. } => {
                ResponseStatus::Denied
            }
            Refusal::NotAService | Refusal::UnknownService { .. } => ResponseStatus::NotFound,
            Refusal::NoEndpoints { .. } | Refusal::Config(_) | Refusal::Upstream(_) => {
                ResponseStatus::TargetUnavailable
            }
        }
    }

    /// The `reason` label of `gateway_denied_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::SourceClaim { .. } => "source-claim",
            Refusal::NotAService => "not-a-service",
            Refusal::UnknownService { .. } => "unknown-service",
            Refusal::NotExported { .. } => "not-exported",
            Refusal::Policy { .. } => "policy",
            Refusal::NoEndpoints { .. } => "no-endpoints",
            Refusal::Config(_) => "config",
            Refusal::Upstream(_) => "upstream",
        }
    }
}

/// Why an open stream is closed: its Service changed under it.
#[derive(Debug, thiserror::Error)]
pub enum Revoked {
    #[error("Service {fqdn} is gone")]
    Gone { fqdn: String },
    #[error("Service {fqdn} is no longer exported")]
    NotExported { fqdn: String },
    #[error("{caller} is no longer allowed to call {fqdn} (strait.dev/allowed-identities)")]
    NotAllowed { caller: SpiffeId, fqdn: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refusal_has_its_status_and_reason() {
        let service = ServiceName {
            namespace: "shop".into(),
            name: "web".into(),
        };
        let caller: SpiffeId = "spiffe://mesh/ns/shop/sa/client".parse().unwrap();
        let policy = Refusal::Policy {
            caller,
            service: service.clone(),
        };
        assert_eq!(policy.status(), ResponseStatus::Denied);
        assert_eq!(policy.reason(), "policy");
        assert!(policy.to_string().contains("shop/web"), "{policy}");
        let none = Refusal::NoEndpoints { service };
        assert_eq!(none.status(), ResponseStatus::TargetUnavailable);
        assert_eq!(Refusal::NotAService.status(), ResponseStatus::NotFound);
    }
}
