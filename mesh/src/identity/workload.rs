//! How a Strait component (mirror controller, gateway, node proxy) gets its own
//! identity: the same four flags everywhere, a projected ServiceAccount token
//! traded at the cluster's issuer for a short-lived certificate kept fresh.

use std::path::PathBuf;

use super::client::{
    IdentityMetrics, IdentityStore, IssueError, IssuerClient, ManagedIdentity, RefreshPolicy,
    TokenSource,
};
use super::tls::{TlsError, TrustBundle};

/// Command-line flags shared by every component that holds an identity.
#[derive(Clone, Debug, clap::Args)]
pub struct IdentityArgs {
    /// The issuer's address (`host:port`).
    #[arg(
        long,
        env = "STRAIT_ISSUER_ADDR",
        default_value = "strait-identity.strait-system.svc:8080"
    )]
    pub issuer_addr: String,
    /// DNS name in the issuer's serving certificate.
    #[arg(
        long,
        env = "STRAIT_ISSUER_NAME",
        default_value = "strait-identity.strait-system.svc"
    )]
    pub issuer_name: String,
    /// PEM file of the trust anchor(s) every peer must chain to.
    #[arg(
        long,
        env = "STRAIT_TRUST_ANCHORS",
        default_value = "/var/run/strait/trust-anchors/ca.crt"
    )]
    pub trust_anchors: PathBuf,
    /// Projected ServiceAccount token (audience `strait.dev/identity`), read again on every refresh.
    #[arg(
        long,
        env = "STRAIT_IDENTITY_TOKEN",
        default_value = "/var/run/secrets/strait/tokens/identity"
    )]
    pub token_file: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum WorkloadIdentityError {
    #[error(
        "reading trust anchors {path}: {source}; mount the trust-anchor ConfigMap or pass --trust-anchors"
    )]
    Anchors {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("trust anchors {path}: {source}")]
    BadAnchors { path: PathBuf, source: TlsError },
    #[error("issuer client: {0}")]
    Client(#[from] TlsError),
    #[error("getting this component's certificate: {0}")]
    Issue(#[from] IssueError),
}

/// A component's identity: its refreshed certificate and the trust bundle.
#[derive(Debug)]
pub struct WorkloadIdentity {
    pub identity: ManagedIdentity,
    pub bundle: TrustBundle,
}

impl IdentityArgs {
    /// The trust anchors every peer must chain to.
    pub fn bundle(&self) -> Result<TrustBundle, WorkloadIdentityError> {
        let pem = std::fs::read(&self.trust_anchors).map_err(|source| {
            WorkloadIdentityError::Anchors {
                path: self.trust_anchors.clone(),
                source,
            }
        })?;
        TrustBundle::from_pem(&pem).map_err(|source| WorkloadIdentityError::BadAnchors {
            path: self.trust_anchors.clone(),
            source,
        })
    }

    /// A store of identities fetched with this component's token: its own and,
    /// for a node proxy, those of the pods on its node.
    pub fn store(
        &self,
        metrics: IdentityMetrics,
    ) -> Result<(IdentityStore, TrustBundle), WorkloadIdentityError> {
        let bundle = self.bundle()?;
        let client = IssuerClient::new(&self.issuer_addr, &self.issuer_name, &bundle)?;
        let store = IdentityStore::new(
            client,
            TokenSource::File(self.token_file.clone()),
            RefreshPolicy::default(),
            metrics,
        );
        Ok((store, bundle))
    }

    /// Reads the trust anchors and fetches the first certificate (the caller
    /// waits for it: without an identity a component cannot do its job),
    /// waiting out an issuer that is not reachable yet.
    pub async fn start(
        &self,
        metrics: IdentityMetrics,
    ) -> Result<WorkloadIdentity, WorkloadIdentityError> {
        let bundle = self.bundle()?;
        let client = IssuerClient::new(&self.issuer_addr, &self.issuer_name, &bundle)?;
        let token = TokenSource::File(self.token_file.clone());
        let identity = super::client::retry_transient(|| {
            ManagedIdentity::start(
                client.clone(),
                token.clone(),
                None,
                RefreshPolicy::default(),
                metrics.clone(),
            )
        })
        .await?;
        Ok(WorkloadIdentity { identity, bundle })
    }
}
