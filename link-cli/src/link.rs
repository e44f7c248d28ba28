//! `strait link` and `strait unlink`.
//!
//! `strait link` runs against the TARGET cluster (the one whose services will be
//! mirrored). There it ensures a ServiceAccount that may only read Services and
//! EndpointSlices and request tokens for itself, gets an expiring token through
//! the TokenRequest API, and prints what the SOURCE cluster needs: a Namespace,
//! the credentials Secret (a kubeconfig) and the Link.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use base64::Engine as _;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use strait_mesh::link::{Link, LinkSpec, TRUST_ANCHORS_CONFIGMAP};
use strait_mesh::mcs::{CLUSTER_ID_PROPERTY, ClusterProperty, MCS_GROUP};
use strait_mesh::names::{
    CLUSTER_NAME_LABEL, GATEWAY_IDENTITY_ANNOTATION, GATEWAY_SERVICE, LINK_SERVICE_ACCOUNT_PREFIX,
    MIRRORED_LABEL, PROBE_ANNOTATIONS, SYSTEM_NAMESPACE,
};

use crate::identity::Format;

/// Namespace of Links and credentials on the source, and of link access objects on the target.
pub use strait_mesh::names::LINK_NAMESPACE;
/// ClusterRole on the target that link ServiceAccounts are bound to.
pub const READER_ROLE: &str = "strait-link-reader";
const FIELD_MANAGER: &str = "strait-cli";

#[derive(Debug, clap::Args)]
pub struct LinkArgs {
    /// Kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the TARGET cluster (whose services will be mirrored).
    #[arg(long)]
    pub context: Option<String>,
    /// The target cluster's name; mirrors are `<svc>-<name>`. Default: the
    /// target's ClusterProperty `cluster.clusterset.k8s.io` (which `strait
    /// install` sets); a name that disagrees with it is refused.
    #[arg(long)]
    pub cluster_name: Option<String>,
    /// DNS domain of the target cluster.
    #[arg(long, default_value = "cluster.local")]
    pub cluster_domain: String,
    /// Gateway addresses (IPs or hostnames); default: from the target's strait-gateway Service.
    #[arg(long, value_delimiter = ',')]
    pub gateway_addresses: Vec<String>,
    /// Gateway port; default: from the target's strait-gateway Service, else 4143.
    #[arg(long)]
    pub gateway_port: Option<u16>,
    /// Gateway SPIFFE ID; default: from the target's strait-gateway Service annotation.
    #[arg(long)]
    pub gateway_identity: Option<String>,
    /// Lifetime of the link token; the mirror controller renews it before it expires.
    #[arg(long, default_value = "24h", value_parser = humantime::parse_duration)]
    pub token_ttl: Duration,
    /// Server URL the source cluster should use for the target's API (default: the kubeconfig's).
    #[arg(long)]
    pub api_server_address: Option<String>,
    #[arg(short, long, value_enum, default_value = "yaml")]
    pub output: Format,
}

#[derive(Debug, clap::Args)]
pub struct UnlinkArgs {
    /// Kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the SOURCE cluster (where the Link and mirrors live).
    #[arg(long)]
    pub context: Option<String>,
    /// Context of the TARGET cluster, to remove the link's access objects there too.
    #[arg(long)]
    pub target_context: Option<String>,
    /// The linked cluster's name.
    #[arg(long)]
    pub cluster_name: String,
}

pub(crate) fn load_kubeconfig(path: &Option<PathBuf>) -> anyhow::Result<Kubeconfig> {
    match path {
        Some(p) => {
            Kubeconfig::read_from(p).with_context(|| format!("read kubeconfig {}", p.display()))
        }
        None => Kubeconfig::read().context("read the kubeconfig ($KUBECONFIG or ~/.kube/config)"),
    }
}

pub(crate) async fn client_for(
    kubeconfig: &Kubeconfig,
    context: &Option<String>,
) -> anyhow::Result<(Client, kube::Config)> {
    let options = KubeConfigOptions {
        context: context.clone(),
        ..Default::default()
    };
    let config = kube::Config::from_custom_kubeconfig(kubeconfig.clone(), &options)
        .await
        .with_context(|| {
            format!(
                "use context {:?}",
                context.as_deref().unwrap_or("(current)")
            )
        })?;
    Ok((Client::try_from(config.clone())?, config))
}

fn service_account_name(cluster_name: &str) -> String {
    format!("{LINK_SERVICE_ACCOUNT_PREFIX}{cluster_name}")
}

async fn apply<K>(api: &Api<K>, name: &str, value: serde_json::Value) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(value),
    )
    .await
    .with_context(|| format!("apply {name}"))?;
    Ok(())
}

/// Ensures the target-side access objects; returns the ServiceAccount name.
pub async fn ensure_remote_access(target: &Client, cluster_name: &str) -> anyhow::Result<String> {
    let sa = service_account_name(cluster_name);
    let labels = json!({"app.kubernetes.io/part-of": "strait", CLUSTER_NAME_LABEL: cluster_name});
    apply(&Api::<Namespace>::all(target.clone()), LINK_NAMESPACE, json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": LINK_NAMESPACE, "labels": {"app.kubernetes.io/part-of": "strait"}},
    }))
    .await?;
    apply(&Api::<ServiceAccount>::namespaced(target.clone(), LINK_NAMESPACE), &sa, json!({
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": LINK_NAMESPACE, "labels": labels},
    }))
    .await?;
    apply(&Api::<ClusterRole>::all(target.clone()), READER_ROLE, json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": READER_ROLE, "labels": {"app.kubernetes.io/part-of": "strait"}},
        "rules": [
            {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
            // The trust anchors only (public certificates), so `strait check` can compare them.
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [TRUST_ANCHORS_CONFIGMAP], "verbs": ["get"]},
            // The clusterset's exports, and the cluster's name (KEP-2149) to check the Link by.
            {"apiGroups": [MCS_GROUP], "resources": ["serviceexports"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["about.k8s.io"], "resources": ["clusterproperties"], "resourceNames": [CLUSTER_ID_PROPERTY], "verbs": ["get"]},
        ],
    }))
    .await?;
    apply(&Api::<ClusterRoleBinding>::all(target.clone()), &sa, json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": sa, "labels": labels},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": READER_ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": LINK_NAMESPACE}],
    }))
    .await?;
    // May request tokens for itself, and for nobody else.
    apply(&Api::<Role>::namespaced(target.clone(), LINK_NAMESPACE), &sa, json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": sa, "namespace": LINK_NAMESPACE, "labels": labels},
        "rules": [{"apiGroups": [""], "resources": ["serviceaccounts/token"], "resourceNames": [sa], "verbs": ["create"]}],
    }))
    .await?;
    apply(
        &Api::<RoleBinding>::namespaced(target.clone(), LINK_NAMESPACE),
        &sa,
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": sa, "namespace": LINK_NAMESPACE, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": LINK_NAMESPACE}],
        }),
    )
    .await?;
    Ok(sa)
}

/// An expiring token for the link ServiceAccount (never a legacy Secret token).
pub async fn request_token(target: &Client, sa: &str, ttl: Duration) -> anyhow::Result<String> {
    let request: TokenRequest =
        serde_json::from_value(json!({"spec": {"expirationSeconds": ttl.as_secs()}}))?;
    Api::<ServiceAccount>::namespaced(target.clone(), LINK_NAMESPACE)
        .create_token_request(sa, &PostParams::default(), &request)
        .await
        .context("TokenRequest for the link ServiceAccount")?
        .status
        .and_then(|s| s.token)
        .context("TokenRequest returned no token")
}

/// A kubeconfig that reaches `server` with `token`, trusting `ca_pem_b64` (base64 PEM, kubeconfig style).
pub fn token_kubeconfig(
    cluster_name: &str,
    server: &str,
    ca_pem_b64: Option<&str>,
    token: &str,
) -> serde_json::Value {
    let mut cluster = json!({"server": server});
    if let Some(ca) = ca_pem_b64 {
        cluster["certificate-authority-data"] = json!(ca);
    }
    json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": cluster_name, "cluster": cluster}],
        "users": [{"name": service_account_name(cluster_name), "user": {"token": token}}],
        "contexts": [{"name": cluster_name, "context": {"cluster": cluster_name, "user": service_account_name(cluster_name)}}],
        "current-context": cluster_name,
    })
}

/// What the target's `strait-system/strait-gateway` Service says about its gateway.
#[derive(Default)]
struct GatewayDefaults {
    addresses: Vec<String>,
    port: Option<u16>,
    identity: Option<String>,
    probe: serde_json::Map<String, serde_json::Value>,
}

/// Gateway defaults from the target's `strait-system/strait-gateway` Service:
/// load-balancer and external addresses, or for a NodePort Service the nodes'
/// addresses (ExternalIP, else InternalIP) and the node port; the identity and
/// probe annotations.
async fn gateway_defaults(target: &Client) -> anyhow::Result<GatewayDefaults> {
    let Ok(Some(svc)) = Api::<Service>::namespaced(target.clone(), SYSTEM_NAMESPACE)
        .get_opt(GATEWAY_SERVICE)
        .await
    else {
        return Ok(GatewayDefaults::default());
    };
    let spec = svc.spec.clone().unwrap_or_default();
    let mut addresses: Vec<String> = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.clone())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|i| i.ip.or(i.hostname))
        .collect();
    addresses.extend(spec.external_ips.clone().unwrap_or_default());
    let tunnel_port = spec.ports.as_ref().and_then(|ports| {
        ports
            .iter()
            .find(|p| p.protocol.as_deref() != Some("UDP") && p.port == 4143)
            .or(ports.first())
    });
    let node_port = spec.type_.as_deref() == Some("NodePort");
    let port = if node_port {
        tunnel_port.and_then(|p| p.node_port)
    } else {
        tunnel_port.map(|p| p.port)
    }
    .and_then(|p| u16::try_from(p).ok());
    if node_port && addresses.is_empty() {
        let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(target.clone())
            .list(&ListParams::default())
            .await
            .context("list the target's nodes (the gateway Service is a NodePort): pass --gateway-addresses instead if you may not")?;
        for node in nodes.items {
            let node_addresses = node.status.and_then(|s| s.addresses).unwrap_or_default();
            let pick = |kind: &str| {
                node_addresses
                    .iter()
                    .find(|a| a.type_ == kind)
                    .map(|a| a.address.clone())
            };
            addresses.extend(pick("ExternalIP").or_else(|| pick("InternalIP")));
        }
    }
    let annotations = svc.annotations();
    let mut probe = serde_json::Map::new();
    for (annotation, field) in PROBE_ANNOTATIONS {
        if let Some(value) = annotations.get(*annotation) {
            let value = if matches!(*field, "port" | "failureThreshold") {
                json!(value.parse::<u32>().with_context(|| format!(
                    "the target's strait-gateway Service has {annotation}: {value:?}, not a number; fix the annotation"
                ))?)
            } else {
                json!(value)
            };
            probe.insert(field.to_string(), value);
        }
    }
    Ok(GatewayDefaults {
        addresses,
        port,
        identity: annotations.get(GATEWAY_IDENTITY_ANNOTATION).cloned(),
        probe,
    })
}

/// The name the target cluster goes by: its ClusterProperty
/// `cluster.clusterset.k8s.io`, which `--cluster-name` may repeat but not
/// contradict (two names for one cluster would split its services in two).
pub async fn target_cluster_name(target: &Client, given: Option<&str>) -> anyhow::Result<String> {
    let property = match Api::<ClusterProperty>::all(target.clone())
        .get_opt(CLUSTER_ID_PROPERTY)
        .await
    {
        Ok(p) => p.map(|p| p.spec.value),
        // No ClusterProperty API: installed before Strait set it.
        Err(kube::Error::Api(e)) if e.code == 404 => None,
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!(
                "reading the target's ClusterProperty {CLUSTER_ID_PROPERTY} (its cluster name)"
            )));
        }
    };
    match (property, given) {
        (Some(name), Some(given)) if name != given => bail!(
            "the target cluster calls itself {name:?} (ClusterProperty {CLUSTER_ID_PROPERTY}), not {given:?}: drop --cluster-name, or pass --cluster-name {name}"
        ),
        (Some(name), _) => Ok(name),
        (None, Some(given)) => Ok(given.to_string()),
        (None, None) => bail!(
            "the target cluster has no ClusterProperty {CLUSTER_ID_PROPERTY} (its name; `strait install` sets it through the mirror controller): pass --cluster-name"
        ),
    }
}

pub async fn link(args: LinkArgs) -> anyhow::Result<String> {
    let kubeconfig = load_kubeconfig(&args.kubeconfig)?;
    let (target, config) = client_for(&kubeconfig, &args.context).await?;
    let cluster_name = target_cluster_name(&target, args.cluster_name.as_deref()).await?;
    let sa = ensure_remote_access(&target, &cluster_name).await?;
    let token = request_token(&target, &sa, args.token_ttl).await?;

    let server = args.api_server_address.clone().unwrap_or_else(|| {
        config
            .cluster_url
            .to_string()
            .trim_end_matches('/')
            .to_string()
    });
    let ca = config.root_cert.as_ref().map(|ders| {
        let pem: String = ders
            .iter()
            .map(|der| {
                let body = base64::engine::general_purpose::STANDARD.encode(der);
                let lines: Vec<&str> = body
                    .as_bytes()
                    .chunks(64)
                    .map(|c| std::str::from_utf8(c).unwrap_or(""))
                    .collect();
                format!(
                    "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
                    lines.join("\n")
                )
            })
            .collect();
        base64::engine::general_purpose::STANDARD.encode(pem)
    });
    let remote_kubeconfig = token_kubeconfig(&cluster_name, &server, ca.as_deref(), &token);

    let defaults = gateway_defaults(&target).await?;
    let gateway_addresses = if args.gateway_addresses.is_empty() {
        defaults.addresses
    } else {
        args.gateway_addresses.clone()
    };
    if gateway_addresses.is_empty() {
        eprintln!(
            "warning: no gateway address given or found (strait-system/strait-gateway): mirrors will have no endpoints until --gateway-addresses is set on the Link"
        );
    }
    let gateway_identity = args
        .gateway_identity
        .clone()
        .or(defaults.identity)
        .unwrap_or_else(|| "spiffe://cluster.local/ns/strait-system/sa/strait-gateway".to_string());
    let secret_name = format!("cluster-credentials-{}", cluster_name);
    let spec: LinkSpec = serde_json::from_value(json!({
        "targetClusterName": cluster_name,
        "targetClusterDomain": args.cluster_domain,
        "clusterCredentialsSecret": secret_name,
        "gatewayAddresses": gateway_addresses,
        "gatewayPort": args.gateway_port.or(defaults.port).unwrap_or(4143),
        "gatewayIdentity": gateway_identity,
        "probe": defaults.probe,
    }))?;
    let docs = vec![
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": LINK_NAMESPACE}}),
        json!({
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": secret_name, "namespace": LINK_NAMESPACE,
                         "labels": {CLUSTER_NAME_LABEL: cluster_name, "app.kubernetes.io/part-of": "strait"}},
            "stringData": {"kubeconfig": serde_yaml::to_string(&remote_kubeconfig)?},
        }),
        json!({
            "apiVersion": "multicluster.strait.dev/v1alpha1", "kind": "Link",
            "metadata": {"name": cluster_name, "namespace": LINK_NAMESPACE},
            "spec": spec,
        }),
    ];
    Ok(match args.output {
        Format::Yaml => docs
            .iter()
            .map(serde_yaml::to_string)
            .collect::<Result<Vec<_>, _>>()?
            .join("---\n"),
        Format::Json => {
            serde_json::to_string_pretty(
                &json!({"apiVersion": "v1", "kind": "List", "items": docs}),
            )? + "\n"
        }
    })
}

pub async fn unlink(args: UnlinkArgs) -> anyhow::Result<()> {
    let kubeconfig = load_kubeconfig(&args.kubeconfig)?;
    let (source, _) = client_for(&kubeconfig, &args.context).await?;
    let name = &args.cluster_name;
    let links: Api<Link> = Api::namespaced(source.clone(), LINK_NAMESPACE);
    let found = links.get_opt(name).await.context("read the Link")?;
    if found.is_none() && args.target_context.is_none() {
        bail!(
            "no Link {LINK_NAMESPACE}/{name} in this cluster: check --context and --cluster-name"
        );
    }
    if found.is_some() {
        links
            .delete(name, &DeleteParams::default())
            .await
            .context("delete the Link")?;
        // The controller's finalizer removes the mirrors; wait for it, briefly.
        for _ in 0..100 {
            if links.get_opt(name).await?.is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if links.get_opt(name).await?.is_some() {
            eprintln!(
                "warning: the Link is still terminating (is strait-mirror running?); its mirrors go when it finishes"
            );
        }
    }
    // Mirrors left without a controller (none running) go too: only what is
    // Strait's mirror of this cluster (the controller's ownership rule), and
    // only the object that was read (uid and resourceVersion preconditions).
    let selector = format!("{MIRRORED_LABEL}=true,{CLUSTER_NAME_LABEL}={name}");
    let delete_if_ours = |meta: &kube::api::ObjectMeta| {
        strait_mesh::names::is_mirror_of(meta, name).then(|| DeleteParams {
            preconditions: Some(kube::api::Preconditions {
                uid: meta.uid.clone(),
                resource_version: meta.resource_version.clone(),
            }),
            ..DeleteParams::default()
        })
    };
    for svc in Api::<Service>::all(source.clone())
        .list_metadata(&ListParams::default().labels(&selector))
        .await?
        .items
    {
        let ns = svc.namespace().unwrap_or_default();
        if let Some(dp) = delete_if_ours(&svc.metadata) {
            let _ = Api::<Service>::namespaced(source.clone(), &ns)
                .delete(&svc.name_any(), &dp)
                .await;
        }
    }
    for slice in Api::<k8s_openapi::api::discovery::v1::EndpointSlice>::all(source.clone())
        .list_metadata(&ListParams::default().labels(&selector))
        .await?
        .items
    {
        let ns = slice.namespace().unwrap_or_default();
        if let Some(dp) = delete_if_ours(&slice.metadata) {
            let _ = Api::<k8s_openapi::api::discovery::v1::EndpointSlice>::namespaced(
                source.clone(),
                &ns,
            )
            .delete(&slice.name_any(), &dp)
            .await;
        }
    }
    let _ = Api::<Secret>::namespaced(source.clone(), LINK_NAMESPACE)
        .delete(
            &format!("cluster-credentials-{name}"),
            &DeleteParams::default(),
        )
        .await;
    eprintln!("unlinked {name} from the source cluster");
    if let Some(target_context) = &args.target_context {
        let (target, _) = client_for(&kubeconfig, &Some(target_context.clone())).await?;
        let sa = service_account_name(name);
        let dp = DeleteParams::default();
        let _ = Api::<RoleBinding>::namespaced(target.clone(), LINK_NAMESPACE)
            .delete(&sa, &dp)
            .await;
        let _ = Api::<Role>::namespaced(target.clone(), LINK_NAMESPACE)
            .delete(&sa, &dp)
            .await;
        let _ = Api::<ClusterRoleBinding>::all(target.clone())
            .delete(&sa, &dp)
            .await;
        let _ = Api::<ServiceAccount>::namespaced(target.clone(), LINK_NAMESPACE)
            .delete(&sa, &dp)
            .await;
        eprintln!(
            "removed the link's access (ServiceAccount {LINK_NAMESPACE}/{sa} and its bindings) from the target"
        );
    }
    Ok(())
}
