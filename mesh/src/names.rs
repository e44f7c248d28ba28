//! Strait's names as Kubernetes and its peers see them, each spelled once:
//! labels, annotations, Strait's own namespace and accounts, the header the
//! destination reads, and the one rule on who may name a caller other than
//! itself.

use crate::identity::SpiffeId;

/// The domain under which each cluster gets its own trust domain by default
/// (`east.clusterset.local`), after the MCS API's `clusterset.local` zone.
pub const CLUSTERSET_DOMAIN: &str = "clusterset.local";
/// The trust domain of installs whose issuer carries no name constraint
/// (made before per-cluster trust domains): every cluster shared it.
pub const LEGACY_TRUST_DOMAIN: &str = "cluster.local";

/// The default trust domain of `cluster` under `clusterset_domain`.
pub fn cluster_trust_domain(cluster: &str, clusterset_domain: &str) -> String {
    format!("{cluster}.{clusterset_domain}")
}

/// Names clusters from identities' trust domains, for metrics: this
/// cluster's own trust domain is `cluster`; `<c>.clusterset.local` (each
/// cluster's default) is `c`; any other trust domain names itself.
#[derive(Clone, Debug)]
pub struct ClusterNames {
    cluster: String,
    trust_domain: String,
}

impl ClusterNames {
    /// This cluster is `cluster`, its identities under `trust_domain`.
    pub fn new(cluster: &str, trust_domain: &str) -> Self {
        Self {
            cluster: cluster.to_string(),
            trust_domain: trust_domain.to_ascii_lowercase(),
        }
    }

    /// This cluster's name.
    pub fn own(&self) -> &str {
        &self.cluster
    }

    /// The cluster whose identities are under `trust_domain`.
    pub fn of<'a>(&'a self, trust_domain: &'a str) -> &'a str {
        if trust_domain.eq_ignore_ascii_case(&self.trust_domain) {
            return &self.cluster;
        }
        trust_domain
            .strip_suffix(CLUSTERSET_DOMAIN)
            .and_then(|p| p.strip_suffix('.'))
            .filter(|c| !c.is_empty() && !c.contains('.'))
            .unwrap_or(trust_domain)
    }
}

/// The namespace and name of the Service `<name>.<namespace>.svc.<domain>`.
pub fn service_of_fqdn(fqdn: &str) -> Option<(&str, &str)> {
    let (service, _domain) = fqdn.split_once(".svc.")?;
    let (name, namespace) = service.split_once('.')?;
    (!name.is_empty() && !namespace.is_empty() && !namespace.contains('.'))
        .then_some((namespace, name))
}

/// The prefix of every Strait label and annotation.
pub const PREFIX: &str = "strait.dev/";

// ── Labels ──────────────────────────────────────────────────────────────

/// The export label Strait selects by default (`strait.dev/exported=true`).
pub const EXPORT_LABEL: &str = "strait.dev/exported";
/// Label on every mirror Service and EndpointSlice.
pub const MIRRORED_LABEL: &str = "strait.dev/mirrored-service";
/// Label naming the cluster a mirror comes from.
pub const CLUSTER_NAME_LABEL: &str = "strait.dev/cluster-name";

/// Field manager of every mirror write (the mirror controller's).
pub const MIRROR_FIELD_MANAGER: &str = "strait-mirror";

/// The one rule for what Strait may overwrite or delete: a local Service or
/// EndpointSlice is the mirror of `cluster` when it carries the labels Strait
/// sets (`strait.dev/mirrored-service=true`, `strait.dev/cluster-name=<cluster>`)
/// and Strait's field manager wrote it. Anything else of the same name (a
/// user's Service, another Link's mirror) is never touched: not by the mirror
/// controller, not by `strait unlink`.
pub fn is_mirror_of(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    cluster: &str,
) -> bool {
    let label = |k: &str| {
        meta.labels
            .as_ref()
            .and_then(|l| l.get(k))
            .map(String::as_str)
    };
    label(MIRRORED_LABEL) == Some("true")
        && label(CLUSTER_NAME_LABEL) == Some(cluster)
        && meta
            .managed_fields
            .iter()
            .flatten()
            .any(|m| m.manager.as_deref() == Some(MIRROR_FIELD_MANAGER))
}
/// Label on per-pod mirrors naming the headless mirror they belong to.
pub const HEADLESS_OWNER_LABEL: &str = "strait.dev/headless-mirror-svc-name";

// ── Annotations ─────────────────────────────────────────────────────────

/// On a mirror: the remote Service's FQDN.
pub const REMOTE_FQ_NAME_ANNOTATION: &str = "strait.dev/remote-svc-fq-name";
/// On a clusterset service's slice for a linked cluster, in place of
/// `kubernetes.io/service-name`: the derived Service it belongs to. Node
/// proxies read it (and tunnel to the gateway over mTLS); kube-proxy does not,
/// so a caller outside the mesh reaches only this cluster's pods at the
/// ClusterSetIP, never a gateway it cannot speak to.
pub const CLUSTERSET_SLICE_SERVICE_LABEL: &str = "multicluster.strait.dev/derived-service";
/// On a clusterset service's slice for a linked cluster: how many ready
/// endpoints the service has there (the node proxy weighs that cluster by it).
pub const READY_ENDPOINTS_ANNOTATION: &str = "multicluster.strait.dev/ready-endpoints";
/// On mirror EndpointSlices: the gateway's identity.
pub const GATEWAY_IDENTITY_ANNOTATION: &str = "strait.dev/gateway-identity";
/// Service annotation: who may call it from linked clusters through the
/// gateway (comma-separated SPIFFE IDs, `*` matching one path segment or the
/// trust domain). Unset: any identity under the shared trust anchor.
pub const ALLOWED_IDENTITIES_ANNOTATION: &str = "strait.dev/allowed-identities";
/// Pod or Namespace annotation: `enabled` puts the pod's traffic through the
/// node proxy transparently (when the node's CNI plugin enrolls it);
/// `disabled` on a pod overrides its namespace. Default: disabled.
pub const TRANSPARENT_ANNOTATION: &str = "strait.dev/transparent";
/// Service annotation: the longest an HTTP request to it may take, retries
/// included (e.g. `2s`, `500ms`); past it the caller gets a 504.
pub const TIMEOUT_ANNOTATION: &str = "strait.dev/timeout";
/// Service annotation, written by the MCS controller: `true` while a valid
/// ServiceExport exports the Service to the clusterset (the gateway then
/// serves it, as it does Services with the export label).
pub const CLUSTERSET_EXPORTED_ANNOTATION: &str = "multicluster.strait.dev/exported";
/// ServiceExport or Service annotation: which clusters serve a clusterset
/// service's callers: `local` (default: this cluster's pods while any is
/// ready, else the other clusters), `remote` (other clusters while any
/// serves it), `none` (all, balanced per request).
pub const AFFINITY_ANNOTATION: &str = "strait.dev/affinity";
/// Pod, Namespace or Service annotation: ports never protocol-detected.
pub const OPAQUE_PORTS_ANNOTATION: &str = "strait.dev/opaque-ports";

// ── Strait's own objects and identities ─────────────────────────────────

/// Namespace of Strait's own components (issuer, gateway, node proxies).
pub const SYSTEM_NAMESPACE: &str = "strait-system";
/// Namespace of Links, their credentials Secrets and the mirror controller
/// (on the cluster that mirrors), and of the link ServiceAccounts `strait
/// link` creates (on the cluster that is mirrored).
pub const LINK_NAMESPACE: &str = "strait-multicluster";
/// The mirror controller's ServiceAccount, in [`LINK_NAMESPACE`].
pub const MIRROR_SERVICE_ACCOUNT: &str = "strait-mirror";
/// Prefix of the link ServiceAccounts, `strait-link-<cluster>`, whose tokens
/// the linked cluster holds.
pub const LINK_SERVICE_ACCOUNT_PREFIX: &str = "strait-link-";
/// The node proxies' DaemonSet.
pub const NODE_PROXY_DAEMONSET: &str = "strait-proxy";
/// The gateway's Service (and Deployment).
pub const GATEWAY_SERVICE: &str = "strait-gateway";
/// Gateway Service annotations copied into a Link's `spec.probe` by
/// `strait link`: annotation → field.
pub const PROBE_ANNOTATIONS: &[(&str, &str)] = &[
    ("strait.dev/probe-period", "period"),
    ("strait.dev/probe-timeout", "timeout"),
    ("strait.dev/probe-path", "path"),
    ("strait.dev/probe-port", "port"),
    ("strait.dev/probe-failure-threshold", "failureThreshold"),
];
/// The audience a token must carry for the issuer to accept it.
pub const TOKEN_AUDIENCE: &str = "strait.dev/identity";
/// Request header naming the caller's SPIFFE ID, set by the node proxy that
/// delivers the request to the pod (any value the caller sent is replaced).
pub const CLIENT_ID_HEADER: &str = "strait-client-id";

/// A Strait component that carries other workloads' traffic, known by the
/// namespace and ServiceAccount of its identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carrier {
    /// The node proxies (the DaemonSet's pods; the issuer's node agent).
    NodeProxy,
    /// The gateways of linked clusters.
    Gateway,
}

impl Carrier {
    /// The (namespace, ServiceAccount) its pods run as.
    pub const fn account(self) -> (&'static str, &'static str) {
        match self {
            Carrier::NodeProxy => (SYSTEM_NAMESPACE, "strait-proxy"),
            Carrier::Gateway => (SYSTEM_NAMESPACE, GATEWAY_SERVICE),
        }
    }

    /// Which carrier `id` is, if any (any trust domain: the trust anchor
    /// has already vouched for it).
    pub fn of(id: &SpiffeId) -> Option<Self> {
        [Carrier::NodeProxy, Carrier::Gateway]
            .into_iter()
            .find(|c| (id.namespace(), id.service_account()) == c.account())
    }
}

/// Whether `peer`, talking to a `receiver`, may name `claimed` as the caller
/// (a tunnel header's `source`): a node proxy speaks for its node's pods to a
/// gateway, and only for identities of its own trust domain (its cluster's:
/// with per-cluster trust domains, a node proxy of east cannot claim a
/// caller of west); a gateway speaks for remote callers to a node proxy. No
/// one else, and never a carrier to one of its own kind.
pub fn may_speak_for(receiver: Carrier, peer: &SpiffeId, claimed: &SpiffeId) -> bool {
    match (receiver, Carrier::of(peer)) {
        (Carrier::Gateway, Some(Carrier::NodeProxy)) => {
            claimed.trust_domain() == peer.trust_domain()
        }
        (Carrier::NodeProxy, Some(Carrier::Gateway)) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clusters_are_named_from_trust_domains() {
        let names = ClusterNames::new("east", "east.clusterset.local");
        assert_eq!(names.of("east.clusterset.local"), "east");
        assert_eq!(names.of("west.clusterset.local"), "west");
        // A legacy shared trust domain is this cluster's when it is ours…
        assert_eq!(
            ClusterNames::new("east", "cluster.local").of("cluster.local"),
            "east"
        );
        // …and names itself otherwise, as does any other domain.
        assert_eq!(names.of("cluster.local"), "cluster.local");
        assert_eq!(names.of("a.b.clusterset.local"), "a.b.clusterset.local");
        assert_eq!(names.of("clusterset.local"), "clusterset.local");
        assert_eq!(names.of("prod.example.com"), "prod.example.com");
    }

    #[test]
    fn services_are_read_from_fqdns() {
        assert_eq!(
            service_of_fqdn("web.shop.svc.cluster.local"),
            Some(("shop", "web"))
        );
        assert_eq!(
            service_of_fqdn("web.shop.svc.west.example"),
            Some(("shop", "web"))
        );
        assert_eq!(service_of_fqdn("web.svc.cluster.local"), None);
        assert_eq!(service_of_fqdn("a.b.c.svc.cluster.local"), None);
        assert_eq!(service_of_fqdn("web.shop"), None);
    }

    fn id(ns: &str, sa: &str) -> SpiffeId {
        SpiffeId::new("cluster.local", ns, sa).unwrap()
    }

    #[test]
    fn node_proxies_speak_to_gateways_and_gateways_to_node_proxies_only() {
        let proxy = id("strait-system", "strait-proxy");
        let gateway = id("strait-system", "strait-gateway");
        let caller = id("shop", "client");
        let may_speak_for_others =
            |receiver, peer: &SpiffeId| may_speak_for(receiver, peer, &caller);
        assert!(may_speak_for_others(Carrier::Gateway, &proxy));
        assert!(may_speak_for_others(Carrier::NodeProxy, &gateway));
        assert!(!may_speak_for_others(Carrier::Gateway, &gateway));
        assert!(!may_speak_for_others(Carrier::NodeProxy, &proxy));
        for other in [
            id("shop", "strait-proxy"),
            id("strait-system", "default"),
            id("strait-system", "strait-issuer"),
            id("shop", "web"),
        ] {
            assert!(!may_speak_for_others(Carrier::Gateway, &other), "{other}");
            assert!(!may_speak_for_others(Carrier::NodeProxy, &other), "{other}");
        }
        let elsewhere = SpiffeId::new("west.local", "strait-system", "strait-proxy").unwrap();
        assert_eq!(Carrier::of(&elsewhere), Some(Carrier::NodeProxy));
    }

    #[test]
    fn a_node_proxy_speaks_only_for_its_own_trust_domain() {
        let east_proxy = SpiffeId::new("east.cs", "strait-system", "strait-proxy").unwrap();
        let east_caller = SpiffeId::new("east.cs", "shop", "client").unwrap();
        let west_caller = SpiffeId::new("west.cs", "shop", "client").unwrap();
        assert!(may_speak_for(Carrier::Gateway, &east_proxy, &east_caller));
        assert!(!may_speak_for(Carrier::Gateway, &east_proxy, &west_caller));
        // A gateway carries callers of every linked cluster.
        let west_gateway = SpiffeId::new("west.cs", "strait-system", "strait-gateway").unwrap();
        assert!(may_speak_for(
            Carrier::NodeProxy,
            &west_gateway,
            &east_caller
        ));
    }
}
