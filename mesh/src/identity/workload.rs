//! How a Strait component (mirror controller, gateway, node proxy) gets its own
//! identity: the same four flags everywhere, a projected ServiceAccount token
//! traded at the cluster's issuer for a short-lived certificate kept fresh,
//! and the trust-anchor file watched: a changed bundle is swapped in live
//! (verifiers follow at the next handshake; certificates not under the new
//! active anchor are re-fetched), so a rotation needs no restart.

use std::path::{Path, PathBuf};
use std::time::Duration;

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
    /// How often the trust-anchor file is read again (a mounted ConfigMap
    /// changes in place when the kubelet syncs it).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub trust_anchors_poll: Duration,
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
    /// The trust anchors every peer must chain to, read now and then watched
    /// (every `trust_anchors_poll`) for the life of the process.
    pub fn bundle(&self, metrics: &IdentityMetrics) -> Result<TrustBundle, WorkloadIdentityError> {
        let pem = std::fs::read(&self.trust_anchors).map_err(|source| {
            WorkloadIdentityError::Anchors {
                path: self.trust_anchors.clone(),
                source,
            }
        })?;
        let bundle = TrustBundle::from_pem(&pem)
            .map_err(|source| WorkloadIdentityError::BadAnchors {
                path: self.trust_anchors.clone(),
                source: source.into(),
            })?
            .with_refusal_log(metrics.refusals())
            .with_anchor_info(metrics.anchor_info());
        tokio::spawn(watch_anchors(
            self.trust_anchors.clone(),
            bundle.clone(),
            self.trust_anchors_poll,
        ));
        Ok(bundle)
    }

    /// A store of identities fetched with this component's token: its own and,
    /// for a node proxy, those of the pods on its node.
    pub fn store(
        &self,
        metrics: IdentityMetrics,
    ) -> Result<(IdentityStore, TrustBundle), WorkloadIdentityError> {
        let bundle = self.bundle(&metrics)?;
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
        let bundle = self.bundle(&metrics)?;
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

/// Reads `path` every `every` and swaps a changed bundle into `bundle`. A file
/// that cannot be read or parsed keeps the last good bundle (logged once per
/// distinct problem): a half-written ConfigMap must not drop every peer.
pub async fn watch_anchors(path: PathBuf, bundle: TrustBundle, every: Duration) {
    let mut last_problem: Option<String> = None;
    loop {
        tokio::time::sleep(every).await;
        match reload(&path, &bundle) {
            Ok(changed) => {
                last_problem = None;
                if changed {
                    let prints = bundle.fingerprints();
                    tracing::info!(
                        path = %path.display(),
                        anchors = prints.len(),
                        active = %prints.first().map(|p| &p[..16]).unwrap_or("-"),
                        "trust anchors changed: verifying peers with the new bundle"
                    );
                }
            }
            Err(problem) => {
                if last_problem.as_ref() != Some(&problem) {
                    tracing::warn!(path = %path.display(), "keeping the last good trust anchors: {problem}");
                    last_problem = Some(problem);
                }
            }
        }
    }
}

fn reload(path: &Path, bundle: &TrustBundle) -> Result<bool, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read it: {e}"))?;
    bundle.replace_from_pem(&pem).map_err(|e| e.to_string())
}
