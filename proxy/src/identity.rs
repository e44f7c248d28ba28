//! The identities a node proxy holds: one per ServiceAccount of the pods on
//! its node, obtained from the issuer on the pod's behalf (the issuer checks
//! that the pod runs on this proxy's node) and kept fresh.
//!
//! Between proxies, both ends present the *pods'* identities: the client side
//! the calling pod's, the server side the called pod's. The server picks its
//! certificate from the TLS server name, which names the identity the client
//! expects ([`server_name_for`]): connections arrive at the node's address, not
//! the pod's, so the name is the only hint of which pod they are for. The
//! inbound side reads the ClientHello first, fetches that identity if it has
//! not yet (only for a ServiceAccount one of its pods runs as), then answers.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use strait_mesh::identity::SpiffeId;
use strait_mesh::identity::client::{IdentityStore, IssueError, ManagedIdentity};
use strait_mesh::identity::protocol::PodRef;
use strait_mesh::identity::tls::{self, TrustBundle};

pub use strait_mesh::tunnel::{TUNNEL_ALPN, parse_server_name, server_name_for};

/// How callers are proven through gateways (`--end-to-end-identity`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum EndToEnd {
    /// Send the proof; refuse a gateway-carried caller without one (default).
    #[default]
    Strict,
    /// Send the proof; believe this cluster's gateway about a caller that
    /// brings none (while linked clusters still run proxies without it).
    Permissive,
    /// Neither send nor require it (to call through gateways that do not know
    /// the end-to-end field yet); the gateway's word is believed.
    Off,
}

impl EndToEnd {
    /// Whether calls through gateways carry the caller's proof.
    pub fn sends(self) -> bool {
        self != EndToEnd::Off
    }

    /// Whether a gateway-carried caller must prove itself.
    pub fn requires(self) -> bool {
        self == EndToEnd::Strict
    }
}

/// What to do with a held identity, given the pod it is fetched for and the
/// pods of its account on the node now.
#[derive(Debug, PartialEq, Eq)]
enum Follow {
    Keep,
    Rebind(PodRef),
    Drop,
}

fn follow(bound: Option<&PodRef>, pods: &[PodRef]) -> Follow {
    match (bound, pods.first()) {
        (_, None) => Follow::Drop,
        (Some(bound), Some(_)) if pods.contains(bound) => Follow::Keep,
        // The oldest name first would need creation times; any pod of the
        // account serves, and the lowest name keeps the choice stable.
        (_, Some(_)) => Follow::Rebind(
            pods.iter()
                .min_by(|a, b| a.name.cmp(&b.name))
                .cloned()
                .expect("not empty"),
        ),
    }
}

/// Identities of this node's pods, by (namespace, service account).
#[derive(Debug)]
pub struct PodIdentities {
    store: IdentityStore,
    bundle: TrustBundle,
    trust_domain: String,
    end_to_end: EndToEnd,
    by_account: RwLock<HashMap<(String, String), Arc<ManagedIdentity>>>,
    server_configs: RwLock<HashMap<(String, String), Arc<rustls::ServerConfig>>>,
}

impl PodIdentities {
    pub fn new(
        store: IdentityStore,
        bundle: TrustBundle,
        trust_domain: &str,
        end_to_end: EndToEnd,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            bundle,
            trust_domain: trust_domain.to_string(),
            end_to_end,
            by_account: RwLock::new(HashMap::new()),
            server_configs: RwLock::new(HashMap::new()),
        })
    }

    pub fn bundle(&self) -> &TrustBundle {
        &self.bundle
    }

    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    pub fn end_to_end(&self) -> EndToEnd {
        self.end_to_end
    }

    /// The identity of `pod` (running as `service_account`), fetched once per
    /// ServiceAccount and then served from memory.
    pub async fn for_pod(
        &self,
        pod: &PodRef,
        service_account: &str,
    ) -> Result<Arc<ManagedIdentity>, IssueError> {
        let key = (pod.namespace.clone(), service_account.to_string());
        if let Some(found) = self.lookup(&key) {
            return Ok(found);
        }
        let identity = self.store.get(Some(pod.clone())).await?;
        self.by_account
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, identity.clone());
        Ok(identity)
    }

    /// Keeps each held identity bound to a pod that still runs on this node
    /// (`local`: the node's pods now): the issuer certifies an account only
    /// on behalf of one of its pods here, so when the pod an identity was
    /// fetched for leaves, the next refresh names another pod of that
    /// account (at once, proving it); when none is left, the identity is
    /// dropped (no refreshes, no server config, no metric series).
    pub async fn follow_pods<'a>(
        &self,
        local: impl IntoIterator<Item = &'a strait_mesh::discovery::PodInfo>,
    ) {
        let mut by_account: HashMap<(String, String), Vec<PodRef>> = HashMap::new();
        for pod in local {
            by_account
                .entry((pod.namespace.clone(), pod.service_account.clone()))
                .or_default()
                .push(PodRef {
                    namespace: pod.namespace.clone(),
                    name: pod.name.clone(),
                });
        }
        let held: Vec<((String, String), Arc<ManagedIdentity>)> = self
            .by_account
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (key, identity) in held {
            let pods = by_account.get(&key).map(Vec::as_slice).unwrap_or_default();
            match follow(identity.pod().as_ref(), pods) {
                Follow::Keep => {}
                Follow::Rebind(pod) => {
                    tracing::info!(
                        namespace = %key.0, account = %key.1, pod = %pod.name,
                        "the pod this identity was fetched for left the node: refreshing it for another pod of the account"
                    );
                    identity.rebind(pod);
                }
                Follow::Drop => {
                    tracing::info!(namespace = %key.0, account = %key.1, "no pod of this account is left on the node: dropping its identity");
                    self.by_account
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .retain(|k, held| !(k == &key && Arc::ptr_eq(held, &identity)));
                    self.server_configs
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&key);
                    self.store.forget(&identity).await;
                }
            }
        }
    }

    /// Identities held now (one per ServiceAccount with pods on this node).
    pub fn held(&self) -> usize {
        self.by_account
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    fn lookup(&self, key: &(String, String)) -> Option<Arc<ManagedIdentity>> {
        self.by_account
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned()
    }

    /// A client config presenting `source` and accepting only `destination`.
    pub fn client_config(
        &self,
        source: &ManagedIdentity,
        destination: SpiffeId,
    ) -> Result<Arc<rustls::ClientConfig>, tls::TlsError> {
        tls::client_config(
            &self.bundle,
            source.cert(),
            vec![destination],
            &[TUNNEL_ALPN],
        )
        .map(Arc::new)
    }

    /// The end-to-end session's client config: presents `source`, accepts any
    /// workload of `namespace` in `trust_domain` (the remote Service's).
    pub fn end_to_end_config(
        &self,
        source: &ManagedIdentity,
        trust_domain: &str,
        namespace: &str,
    ) -> Result<Arc<rustls::ClientConfig>, tls::TlsError> {
        tls::client_config_expecting(
            &self.bundle,
            source.cert(),
            tls::Expected::Namespace {
                trust_domain: trust_domain.to_string(),
                namespace: namespace.to_string(),
            },
            &[TUNNEL_ALPN],
        )
        .map(Arc::new)
    }

    /// The inbound server config for one identity: client certificates
    /// required (chained to the trust anchors), TLS 1.3, the tunnel ALPN.
    /// Cached: the certificate slot inside follows every refresh.
    pub fn server_config(
        &self,
        identity: &ManagedIdentity,
    ) -> Result<Arc<rustls::ServerConfig>, tls::TlsError> {
        let id = identity.id();
        let key = (id.namespace().to_string(), id.service_account().to_string());
        if let Some(found) = self
            .server_configs
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return Ok(found.clone());
        }
        let config = Arc::new(tls::server_config(
            &self.bundle,
            identity.cert(),
            &[TUNNEL_ALPN],
        )?);
        self.server_configs
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, config.clone());
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> PodRef {
        PodRef {
            namespace: "shop".into(),
            name: name.into(),
        }
    }

    #[test]
    fn an_identity_follows_the_pods_of_its_account() {
        // Its pod is still there: nothing changes.
        assert_eq!(follow(Some(&pod("a")), &[pod("b"), pod("a")]), Follow::Keep);
        // Its pod left, another of the account runs: fetched for that one.
        assert_eq!(
            follow(Some(&pod("a")), &[pod("c"), pod("b")]),
            Follow::Rebind(pod("b"))
        );
        // None left: dropped.
        assert_eq!(follow(Some(&pod("a")), &[]), Follow::Drop);
        assert_eq!(follow(None, &[]), Follow::Drop);
    }
}
