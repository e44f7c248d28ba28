//! `strait-identity`: one per cluster. Holds the cluster's issuer key (from a
//! mounted Secret; it never leaves this process) and signs short-lived leaf
//! certificates whose only SAN is `spiffe://<trust-domain>/ns/<ns>/sa/<sa>` of
//! the caller's verified ServiceAccount token.
//!
//! Its own binary (not part of the mirror or the proxy) because it is the one
//! process that holds a signing key: it gets its own Deployment, RBAC
//! (TokenReview, reading pods) and blast radius.
#![forbid(unsafe_code)]

pub mod authn;
pub mod server;
pub mod service;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use prometheus_client::registry::Registry;
use strait_mesh::admin::{self, Readiness};
use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::ca::{LeafSigner, PemPair};
use strait_mesh::identity::certs;
use strait_mesh::identity::tls::CertSlot;

use crate::service::{IssuerMetrics, IssuerService, IssuerSettings};

/// Everything the issuer needs to start.
#[derive(Clone, Debug)]
pub struct IssuerConfig {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub issuer_cert: PathBuf,
    pub issuer_key: PathBuf,
    pub trust_anchors: PathBuf,
    /// `None`: the trust domain the issuer certificate is constrained to, else
    /// cluster.local (an issuer made before per-cluster trust domains).
    pub trust_domain: Option<String>,
    pub leaf_validity: Duration,
    pub node_agents: Vec<String>,
    /// Namespaces whose ServiceAccounts are never certified.
    pub refused_namespaces: Vec<String>,
    /// `<namespace>/<serviceaccount>`s certified although their namespace is refused.
    pub refusal_exceptions: Vec<String>,
    /// DNS names in the issuer's own serving certificate.
    pub dns_names: Vec<String>,
    /// Namespace and ServiceAccount the issuer runs as (its own SPIFFE ID).
    pub namespace: String,
    pub service_account: String,
}

/// Starts the issuer and serves until the future is dropped.
pub async fn run(config: IssuerConfig) -> anyhow::Result<()> {
    let read =
        |p: &PathBuf| std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()));
    let pair = PemPair {
        cert_pem: read(&config.issuer_cert)?,
        key_pem: read(&config.issuer_key)?,
    };
    let anchors = read(&config.trust_anchors)?;
    let signer =
        LeafSigner::load(&pair, &anchors).context("the issuer certificate cannot be used")?;
    let trust_domain = match (&config.trust_domain, signer.trust_domain()) {
        (Some(given), Some(pinned)) if given != pinned => anyhow::bail!(
            "--trust-domain {given} disagrees with the issuer certificate, which may only certify {pinned}: drop the flag, or make an issuer for {given} with `strait identity issuer --trust-domain {given}`"
        ),
        (Some(given), _) => given.clone(),
        (None, Some(pinned)) => pinned.to_string(),
        (None, None) => strait_mesh::names::LEGACY_TRUST_DOMAIN.to_string(),
    };
    let issuer_info = certs::inspect(
        "issuer",
        &certs::parse_certs("issuer", pair.cert_pem.as_bytes())?[0],
    )?;
    let accounts = |flag: &str, values: &[String]| {
        values
            .iter()
            .map(|s| {
                s.split_once('/')
                    .filter(|(ns, sa)| !ns.is_empty() && !sa.is_empty())
                    .map(|(ns, sa)| (ns.to_string(), sa.to_string()))
                    .with_context(|| format!("{flag} {s:?}: expected <namespace>/<serviceaccount>"))
            })
            .collect::<anyhow::Result<Vec<_>>>()
    };
    let node_agents = accounts("--node-agent", &config.node_agents)?;
    let refusal_exceptions = accounts("--certify-in-refused", &config.refusal_exceptions)?;
    let own_id = SpiffeId::new(&trust_domain, &config.namespace, &config.service_account)?;

    let client = kube::Client::try_default()
        .await
        .context("connect to the Kubernetes API (in-cluster or KUBECONFIG)")?;
    let metrics = IssuerMetrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let readiness = Readiness::default();
    let admin_addr = admin::spawn(config.admin, readiness.clone(), Arc::new(registry)).await?;

    let settings = IssuerSettings {
        trust_domain: trust_domain.clone(),
        leaf_validity: config.leaf_validity,
        node_agents,
        refused_namespaces: config.refused_namespaces.clone(),
        refusal_exceptions,
    };
    let service = Arc::new(IssuerService::new(
        signer,
        settings,
        client,
        metrics,
        issuer_info.not_after_unix,
    ));

    // The serving certificate: signed by our own issuer, re-signed at 70 % of its life.
    let slot = CertSlot::new();
    let serving_validity = config.leaf_validity.max(Duration::from_secs(3600));
    let renew = {
        let (service, slot, own_id, names) = (
            service.clone(),
            slot.clone(),
            own_id.clone(),
            config.dns_names.clone(),
        );
        move || -> anyhow::Result<()> {
            let key = rcgen::KeyPair::generate()?;
            let signer = service.signer();
            let leaf = signer.sign_with(&key, &own_id, serving_validity, &names)?;
            let mut chain = vec![leaf.der];
            chain.extend(certs::parse_certs(
                "issuer",
                signer.issuer_pem().as_bytes(),
            )?);
            slot.install(chain, &key.serialize_pem())?;
            Ok(())
        }
    };
    renew()?;
    let renew = Arc::new(renew);
    {
        let renew = renew.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(serving_validity.mul_f64(0.7)).await;
                if let Err(e) = renew() {
                    tracing::error!("renewing the issuer's serving certificate failed: {e:#}");
                }
            }
        });
    }
    tokio::spawn(reload_issuer(
        config.clone(),
        trust_domain.clone(),
        service.clone(),
        renew,
    ));
    let mut tls =
        rustls::ServerConfig::builder_with_provider(strait_mesh::identity::tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_cert_resolver(slot);
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];

    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("bind the issuer port {}", config.listen))?;
    tracing::info!(
        listen = %listener.local_addr()?, admin = %admin_addr, trust_domain = %trust_domain,
        issuer = %issuer_info.subject, issuer_expires = %issuer_info.not_after, "identity issuer ready"
    );
    readiness.set_ready(true);
    server::serve(listener, Arc::new(tls), service).await;
    Ok(())
}

/// How often the issuer's files (the mounted issuer Secret) are read again.
const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// Watches the issuer certificate, key and trust anchors: when they change
/// (a rotation re-issued the issuer), the new issuer is checked as at start
/// (a CA whose key matches, valid, signed by an anchor of the bundle, and for
/// the same trust domain) and signs from then on; the serving certificate is
/// re-signed under it at once. A pair that fails the checks (a half-updated
/// Secret: new certificate, old key) keeps the running issuer, logged once.
async fn reload_issuer(
    config: IssuerConfig,
    trust_domain: String,
    service: Arc<IssuerService>,
    renew: Arc<impl Fn() -> anyhow::Result<()>>,
) {
    let read = |p: &PathBuf| std::fs::read_to_string(p).unwrap_or_default();
    let snapshot = || {
        (
            read(&config.issuer_cert),
            read(&config.issuer_key),
            read(&config.trust_anchors),
        )
    };
    let mut current = snapshot();
    let mut last_problem = String::new();
    loop {
        tokio::time::sleep(RELOAD_EVERY).await;
        let next = snapshot();
        if next == current {
            continue;
        }
        let (cert_pem, key_pem, anchors) = next.clone();
        let loaded = LeafSigner::load(&PemPair { cert_pem, key_pem }, &anchors)
            .map_err(|e| e.to_string())
            .and_then(|signer| match signer.trust_domain() {
                Some(pinned) if pinned != trust_domain => Err(format!(
                    "the new issuer may only certify {pinned}, this issuer serves {trust_domain}"
                )),
                _ => Ok(signer),
            });
        match loaded {
            Ok(signer) => {
                let not_after = signer_expiry(&signer);
                service.replace_signer(signer, not_after);
                current = next;
                last_problem.clear();
                match renew() {
                    Ok(()) => {
                        tracing::info!("issuer certificate changed: signing with the new issuer")
                    }
                    Err(e) => tracing::error!(
                        "re-signing the serving certificate under the new issuer failed: {e:#}"
                    ),
                }
            }
            Err(problem) if problem != last_problem => {
                tracing::warn!(
                    "keeping the running issuer: the changed issuer files cannot be used: {problem}"
                );
                last_problem = problem;
            }
            Err(_) => {}
        }
    }
}

fn signer_expiry(signer: &LeafSigner) -> i64 {
    certs::parse_certs("issuer", signer.issuer_pem().as_bytes())
        .ok()
        .and_then(|c| certs::inspect("issuer", &c[0]).ok())
        .map(|i| i.not_after_unix)
        .unwrap_or(0)
}
