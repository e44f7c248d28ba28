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
    pub trust_domain: String,
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
    let own_id = SpiffeId::new(
        &config.trust_domain,
        &config.namespace,
        &config.service_account,
    )?;

    let client = kube::Client::try_default()
        .await
        .context("connect to the Kubernetes API (in-cluster or KUBECONFIG)")?;
    let metrics = IssuerMetrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let readiness = Readiness::default();
    let admin_addr = admin::spawn(config.admin, readiness.clone(), Arc::new(registry)).await?;

    let settings = IssuerSettings {
        trust_domain: config.trust_domain.clone(),
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
            let leaf = service
                .signer()
                .sign_with(&key, &own_id, serving_validity, &names)?;
            let mut chain = vec![leaf.der];
            chain.extend(certs::parse_certs(
                "issuer",
                service.signer().issuer_pem().as_bytes(),
            )?);
            slot.install(chain, &key.serialize_pem())?;
            Ok(())
        }
    };
    renew()?;
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(serving_validity.mul_f64(0.7)).await;
            if let Err(e) = renew() {
                tracing::error!("renewing the issuer's serving certificate failed: {e:#}");
            }
        }
    });
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
        listen = %listener.local_addr()?, admin = %admin_addr, trust_domain = %config.trust_domain,
        issuer = %issuer_info.subject, issuer_expires = %issuer_info.not_after, "identity issuer ready"
    );
    readiness.set_ready(true);
    server::serve(listener, Arc::new(tls), service).await;
    Ok(())
}
