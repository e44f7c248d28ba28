//! `strait install` and `strait uninstall`.
//!
//! `install` renders the manifests of deploy/ (embedded at build time, so the
//! files stay the one source of truth) with this cluster's name, its trust
//! anchor bundle (ConfigMap `strait-trust-anchors`) and its issuer (Secret
//! `strait-identity-issuer`), for `| kubectl apply -f -`. `uninstall` refuses
//! while Links exist, else prints the objects for `| kubectl delete -f -`.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use base64::Engine as _;
use clap::ValueEnum;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::ListParams;
use kube::{Api, ResourceExt};
use rustls::pki_types::UnixTime;
use serde_json::{Value, json};
use strait_mesh::identity::certs;
use strait_mesh::link::{Link, TRUST_ANCHORS_CONFIGMAP};
use strait_mesh::names::{
    CLUSTER_NAME_LABEL, GATEWAY_IDENTITY_ANNOTATION, GATEWAY_SERVICE, SYSTEM_NAMESPACE,
};

use crate::identity::Format;
use crate::link::{LINK_NAMESPACE, READER_ROLE, client_for, load_kubeconfig};

const MCS_CRDS: &str = "mcs/crds.yaml";
const COREDNS_RBAC: &str = "mirror/coredns.yaml";
const MANIFESTS_COREDNS: &str = include_str!("../../deploy/mirror/coredns.yaml");

/// Every manifest `install` renders, in deploy/ order. A test checks that
/// every object under deploy/ (except patches) is among them.
const MANIFESTS: &[(&str, &str)] = &[
    (
        "namespace.yaml",
        include_str!("../../deploy/namespace.yaml"),
    ),
    (
        "mirror/crd.yaml",
        include_str!("../../deploy/mirror/crd.yaml"),
    ),
    // The Multi-Cluster Services API (generated from strait_mesh::mcs). Kept
    // by `uninstall`: other MCS implementations and users' exports may use it.
    (MCS_CRDS, include_str!("../../deploy/mcs/crds.yaml")),
    (
        "identity/rbac.yaml",
        include_str!("../../deploy/identity/rbac.yaml"),
    ),
    (
        "identity/issuer.yaml",
        include_str!("../../deploy/identity/issuer.yaml"),
    ),
    (
        "mirror/rbac.yaml",
        include_str!("../../deploy/mirror/rbac.yaml"),
    ),
    (COREDNS_RBAC, MANIFESTS_COREDNS),
    (
        "mirror/controller.yaml",
        include_str!("../../deploy/mirror/controller.yaml"),
    ),
    (
        "gateway/rbac.yaml",
        include_str!("../../deploy/gateway/rbac.yaml"),
    ),
    (
        "gateway/deployment.yaml",
        include_str!("../../deploy/gateway/deployment.yaml"),
    ),
    (
        "gateway/service.yaml",
        include_str!("../../deploy/gateway/service.yaml"),
    ),
    (
        "proxy/rbac.yaml",
        include_str!("../../deploy/proxy/rbac.yaml"),
    ),
    (
        "proxy/daemonset.yaml",
        include_str!("../../deploy/proxy/daemonset.yaml"),
    ),
    (
        "proxy/service.yaml",
        include_str!("../../deploy/proxy/service.yaml"),
    ),
];

/// `--transparent`: merged into the node-proxy DaemonSet.
const TRANSPARENT_PATCH: &str = include_str!("../../deploy/proxy/transparent/daemonset-patch.yaml");

pub const ISSUER_SECRET: &str = "strait-identity-issuer";
/// The gateways' shared QUIC stateless-reset secret.
const GATEWAY_RESET_KEY_SECRET: &str = "strait-gateway-reset-key";
const ISSUER_CN_PREFIX: &str = "strait issuer ";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ServiceType {
    #[value(name = "LoadBalancer")]
    LoadBalancer,
    #[value(name = "NodePort")]
    NodePort,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PullPolicy {
    #[value(name = "Always")]
    Always,
    #[value(name = "IfNotPresent")]
    IfNotPresent,
    #[value(name = "Never")]
    Never,
}

#[derive(Debug, clap::Args)]
pub struct InstallArgs {
    /// This cluster's name (gateway and proxy metrics, messages). Default: the cluster the
    /// issuer was made for (`strait identity issuer --cluster NAME`); if given, it must match.
    #[arg(long)]
    pub cluster_name: Option<String>,
    /// Folder written by `strait identity issuer --out-dir DIR`: issuer.crt, issuer.key, ca.crt.
    #[arg(long)]
    pub identity_dir: Option<PathBuf>,
    /// The issuer certificate (PEM); default: DIR/issuer.crt.
    #[arg(long)]
    pub issuer_cert: Option<PathBuf>,
    /// The issuer key (PEM); default: DIR/issuer.key.
    #[arg(long)]
    pub issuer_key: Option<PathBuf>,
    /// The trust-anchor bundle (PEM, one or more roots); default: DIR/ca.crt.
    #[arg(long)]
    pub trust_anchors: Option<PathBuf>,
    /// Trust domain of workload identities (spiffe://<trust-domain>/ns/…/sa/…). Default: the
    /// one the issuer is name-constrained to (`strait identity issuer` sets it per cluster);
    /// for an issuer without a constraint (older installs), cluster.local. If given, it must
    /// agree with the issuer's constraint.
    #[arg(long)]
    pub trust_domain: Option<String>,
    /// The cluster's DNS domain.
    #[arg(long, default_value = "cluster.local")]
    pub cluster_domain: String,
    /// How other clusters reach the gateway.
    #[arg(long, value_enum, default_value = "LoadBalancer")]
    pub gateway_service_type: ServiceType,
    /// With NodePort: the node port of the gateway (the same for QUIC/UDP and TCP).
    #[arg(long, default_value_t = 30143, value_parser = clap::value_parser!(u16).range(30000..=32767))]
    pub gateway_node_port: u16,
    /// Image registry (images are <registry>/strait-<component>:<tag>).
    #[arg(long, default_value = "ghcr.io/strait-dev")]
    pub registry: String,
    /// Image tag (default: this release's version; `latest` would make the
    /// kubelet pull on every start).
    #[arg(long, default_value = env!("CARGO_PKG_VERSION"))]
    pub tag: String,
    /// Image pull policy (Kubernetes' default: Always for :latest, else IfNotPresent).
    #[arg(long, value_enum)]
    pub image_pull_policy: Option<PullPolicy>,
    /// Transparent mode: the node proxy (root, NET_ADMIN + SYS_ADMIN) chains
    /// strait-cni into each node's CNI configuration and captures the pods
    /// annotated `strait.dev/transparent: enabled`
    /// (deploy/proxy/transparent/daemonset-patch.yaml).
    #[arg(long)]
    pub transparent: bool,
    /// CoreDNS's ConfigMap (`namespace/name`; its ServiceAccount has the same
    /// name): the mirror controller keeps `clusterset.local` in its Corefile, so
    /// every pod resolves clusterset names (CoreDNS 1.12.2+). Empty: leave
    /// cluster DNS alone (then only Strait's node proxies answer those names,
    /// to transparent pods).
    #[arg(long, default_value = "kube-system/coredns")]
    pub coredns_configmap: String,
    #[arg(short, long, value_enum, default_value = "yaml")]
    pub output: Format,
}

#[derive(Debug, clap::Args)]
pub struct UninstallArgs {
    /// Kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the cluster to uninstall from.
    #[arg(long)]
    pub context: Option<String>,
    #[arg(short, long, value_enum, default_value = "yaml")]
    pub output: Format,
}

/// The cluster's identity, checked.
struct ClusterIdentity {
    cluster: String,
    trust_domain: String,
    issuer_cert: String,
    issuer_key: String,
    bundle: String,
}

fn read(path: &Path, what: &str, flag: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| {
        format!(
            "read the {what} from {} (set it with {flag}, or --identity-dir with the folder `strait identity issuer --out-dir` wrote)",
            path.display()
        )
    })
}

/// A DNS-1123 label: the cluster name ends up in object names (`<svc>-<cluster>`).
fn check_cluster_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if !ok {
        bail!(
            "cluster name {name:?} is not a DNS label (lower-case letters, digits and '-', at most 63, not starting or ending with '-'); mirrors are named <service>-<cluster>"
        );
    }
    Ok(())
}

fn load_identity(args: &InstallArgs) -> anyhow::Result<ClusterIdentity> {
    let pick = |explicit: &Option<PathBuf>, file: &str, flag: &str| -> anyhow::Result<PathBuf> {
        match (explicit, &args.identity_dir) {
            (Some(p), _) => Ok(p.clone()),
            (None, Some(dir)) => Ok(dir.join(file)),
            (None, None) => bail!(
                "no cluster identity given: pass --identity-dir DIR (made by `strait identity issuer --anchor-cert ca.crt --anchor-key ca.key --cluster NAME --out-dir DIR`), or {flag} with the other issuer flags"
            ),
        }
    };
    let cert_path = pick(&args.issuer_cert, "issuer.crt", "--issuer-cert")?;
    let key_path = pick(&args.issuer_key, "issuer.key", "--issuer-key")?;
    let bundle_path = pick(&args.trust_anchors, "ca.crt", "--trust-anchors")?;
    let issuer_cert = read(&cert_path, "issuer certificate", "--issuer-cert")?;
    let issuer_key = read(&key_path, "issuer key", "--issuer-key")?;
    let bundle = read(&bundle_path, "trust-anchor bundle", "--trust-anchors")?;

    let what = format!("issuer certificate {}", cert_path.display());
    let issuer_der = certs::parse_certs(&what, issuer_cert.as_bytes())?
        .into_iter()
        .next()
        .context("no certificate")?;
    let anchors = certs::parse_certs(
        &format!("trust-anchor bundle {}", bundle_path.display()),
        bundle.as_bytes(),
    )?;
    certs::validate_issuer(&what, &issuer_der, &issuer_key, &anchors, UnixTime::now())
        .with_context(|| {
            format!(
                "refusing to install with issuer {} and key {} under the trust anchors {}",
                cert_path.display(),
                key_path.display(),
                bundle_path.display()
            )
        })?;

    let info = certs::inspect(&what, &issuer_der)?;
    let issuer_cluster = common_name(&info.subject)
        .and_then(|cn| cn.strip_prefix(ISSUER_CN_PREFIX))
        .map(str::to_string);
    let cluster = match (&args.cluster_name, issuer_cluster) {
        (Some(given), Some(made_for)) if *given != made_for => bail!(
            "the issuer {} was made for cluster {made_for:?}, not {given:?}: install with --cluster-name {made_for}, or make an issuer for {given} with `strait identity issuer --cluster {given}`",
            cert_path.display()
        ),
        (Some(given), _) => given.clone(),
        (None, Some(made_for)) => made_for,
        (None, None) => bail!(
            "cannot tell which cluster the issuer {} belongs to (subject {:?} was not made by `strait identity issuer`): pass --cluster-name",
            cert_path.display(),
            info.subject
        ),
    };
    check_cluster_name(&cluster)?;
    let constraints = strait_mesh::identity::trust::Constraints::of_issuer(&issuer_der)
        .map_err(|e| anyhow::anyhow!("issuer certificate {}: {e}", cert_path.display()))?;
    let trust_domain = match (&args.trust_domain, constraints.trust_domain()) {
        (Some(given), Some(pinned)) if given != pinned => bail!(
            "the issuer {} may only certify trust domain {pinned:?}, not {given:?}: install with --trust-domain {pinned} (or leave it out), or make an issuer for {given} with `strait identity issuer --trust-domain {given}`",
            cert_path.display()
        ),
        (Some(given), _) => given.clone(),
        (None, Some(pinned)) => pinned.to_string(),
        (None, None) => strait_mesh::names::LEGACY_TRUST_DOMAIN.to_string(),
    };
    let left = info.not_after_unix - UnixTime::now().as_secs() as i64;
    if left < 30 * 24 * 3600 {
        eprintln!(
            "warning: the issuer {} expires in {} days ({}); make a new one soon with `strait identity issuer`",
            cert_path.display(),
            left / 86_400,
            info.not_after
        );
    }
    Ok(ClusterIdentity {
        cluster,
        trust_domain,
        issuer_cert,
        issuer_key,
        bundle,
    })
}

/// `CN=…` out of an X.509 subject string (`CN=strait issuer east, O=Strait`).
fn common_name(subject: &str) -> Option<&str> {
    subject
        .split(", ")
        .find_map(|part| part.trim().strip_prefix("CN="))
}

/// All objects of the embedded manifests, each once (the rbac files repeat
/// their Namespace so a folder can be applied alone), in install order.
fn manifest_objects() -> anyhow::Result<Vec<Value>> {
    manifest_objects_of(MANIFESTS.iter())
}

fn manifest_objects_of<'a>(
    manifests: impl Iterator<Item = &'a (&'a str, &'a str)>,
) -> anyhow::Result<Vec<Value>> {
    use serde::Deserialize as _;
    let mut objects: Vec<Value> = Vec::new();
    for (path, text) in manifests {
        for doc in serde_yaml::Deserializer::from_str(text) {
            let value = Value::deserialize(doc)
                .with_context(|| format!("deploy/{path} is not valid YAML"))?;
            if value.is_null() {
                continue;
            }
            if value.get("kind").is_none() {
                bail!("deploy/{path}: a document without kind");
            }
            if !objects.iter().any(|o| key(o) == key(&value)) {
                objects.push(value);
            }
        }
    }
    objects.sort_by_key(|o| kind_rank(o["kind"].as_str().unwrap_or("")));
    Ok(objects)
}

fn key(o: &Value) -> (String, String, String) {
    let s = |v: &Value| v.as_str().unwrap_or("").to_string();
    (
        s(&o["kind"]),
        s(&o["metadata"]["namespace"]),
        s(&o["metadata"]["name"]),
    )
}

/// Helm's order: what others refer to first.
fn kind_rank(kind: &str) -> usize {
    const ORDER: &[&str] = &[
        "Namespace",
        "CustomResourceDefinition",
        "ServiceAccount",
        "Secret",
        "ConfigMap",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Service",
        "DaemonSet",
        "Deployment",
    ];
    ORDER.iter().position(|k| *k == kind).unwrap_or(ORDER.len())
}

/// Sets `--flag=value` wherever a container already passes `--flag=…`.
fn set_arg(container: &mut Value, flag: &str, value: &str) {
    if let Some(args) = container.get_mut("args").and_then(Value::as_array_mut) {
        let prefix = format!("{flag}=");
        for arg in args.iter_mut() {
            if arg.as_str().is_some_and(|a| a.starts_with(&prefix)) {
                *arg = json!(format!("{prefix}{value}"));
            }
        }
    }
}

/// A strategic merge as `kubectl patch` does it for what the transparent
/// patch holds: objects merge by key, lists of named objects (containers,
/// env, volumes, volumeMounts) merge by `name`, other lists are replaced.
fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (key, value) in p {
                match t.get_mut(key) {
                    Some(existing) => merge(existing, value),
                    None => {
                        t.insert(key.clone(), value.clone());
                    }
                }
            }
        }
        (Value::Array(t), Value::Array(p))
            if p.iter()
                .all(|v| v.get("name").is_some_and(Value::is_string)) =>
        {
            for item in p {
                match t.iter_mut().find(|e| e.get("name") == item.get("name")) {
                    Some(existing) => merge(existing, item),
                    None => t.push(item.clone()),
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// The CoreDNS objects (deploy/mirror/coredns.yaml) pointed at `namespace/name`.
fn point_at_coredns(objects: &mut Vec<Value>, configmap: &str) -> anyhow::Result<()> {
    let coredns_keys: Vec<_> =
        manifest_objects_of([&(COREDNS_RBAC, MANIFESTS_COREDNS)].into_iter())?
            .iter()
            .map(key)
            .collect();
    if configmap.is_empty() {
        objects.retain(|o| !coredns_keys.contains(&key(o)));
        return Ok(());
    }
    let Some((ns, name)) = configmap
        .split_once('/')
        .filter(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains('/'))
    else {
        bail!(
            "--coredns-configmap {configmap:?} is not namespace/name (kubeadm's and kind's: kube-system/coredns; \"\" to leave cluster DNS alone)"
        );
    };
    for o in objects
        .iter_mut()
        .filter(|o| coredns_keys.contains(&key(o)))
    {
        match o["kind"].as_str() {
            Some("Role") => {
                o["metadata"]["namespace"] = json!(ns);
                o["rules"][0]["resourceNames"] = json!([name]);
            }
            Some("RoleBinding") => o["metadata"]["namespace"] = json!(ns),
            Some("ClusterRoleBinding") => {
                o["subjects"] = json!([{"kind": "ServiceAccount", "name": name, "namespace": ns}]);
            }
            _ => {}
        }
    }
    Ok(())
}

fn render(args: &InstallArgs, id: &ClusterIdentity) -> anyhow::Result<Vec<Value>> {
    let mut objects = manifest_objects()?;
    point_at_coredns(&mut objects, &args.coredns_configmap)?;
    if args.transparent {
        use serde::Deserialize as _;
        let patch = Value::deserialize(serde_yaml::Deserializer::from_str(TRANSPARENT_PATCH))
            .context("deploy/proxy/transparent/daemonset-patch.yaml is not valid YAML")?;
        let ds = objects
            .iter_mut()
            .find(|o| key(o) == key(&patch))
            .context("the transparent patch names no DaemonSet of deploy/")?;
        merge(&mut ds["spec"], &patch["spec"]);
    }
    let labels = json!({"app.kubernetes.io/part-of": "strait", CLUSTER_NAME_LABEL: id.cluster});
    for o in objects.iter_mut() {
        let kind = o["kind"].as_str().unwrap_or("").to_string();
        if kind == "Deployment" || kind == "DaemonSet" {
            let containers = o["spec"]["template"]["spec"]["containers"]
                .as_array_mut()
                .context("a workload without containers")?;
            for c in containers {
                let image = c["image"].as_str().unwrap_or("");
                let name = image
                    .rsplit('/')
                    .next()
                    .and_then(|last| last.split(':').next())
                    .unwrap_or("");
                c["image"] = json!(format!(
                    "{}/{name}:{}",
                    args.registry.trim_end_matches('/'),
                    args.tag
                ));
                if let Some(policy) = args.image_pull_policy {
                    c["imagePullPolicy"] = json!(format!("{policy:?}"));
                }
                set_arg(c, "--cluster-name", &id.cluster);
                set_arg(c, "--trust-domain", &id.trust_domain);
                set_arg(c, "--cluster-domain", &args.cluster_domain);
                set_arg(c, "--coredns-configmap", &args.coredns_configmap);
            }
        }
        if kind == "Service" && o["metadata"]["name"] == GATEWAY_SERVICE {
            o["metadata"]["annotations"][GATEWAY_IDENTITY_ANNOTATION] = json!(format!(
                "spiffe://{}/ns/{SYSTEM_NAMESPACE}/sa/{GATEWAY_SERVICE}",
                id.trust_domain
            ));
            o["metadata"]["labels"][CLUSTER_NAME_LABEL] = json!(id.cluster);
            if args.gateway_service_type == ServiceType::NodePort {
                o["spec"]["type"] = json!("NodePort");
                for port in o["spec"]["ports"].as_array_mut().into_iter().flatten() {
                    if port["port"] == 4143 {
                        port["nodePort"] = json!(args.gateway_node_port);
                    }
                }
            }
        }
    }
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let mut extra = Vec::new();
    // The mirror controller (strait-multicluster) needs the anchors too, for its probe identity.
    for ns in [SYSTEM_NAMESPACE, LINK_NAMESPACE] {
        extra.push(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": TRUST_ANCHORS_CONFIGMAP, "namespace": ns, "labels": labels},
            "data": {"ca.crt": id.bundle},
        }));
    }
    extra.push(json!({
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": ISSUER_SECRET, "namespace": SYSTEM_NAMESPACE,
                     "labels": {"app.kubernetes.io/part-of": "strait", "app.kubernetes.io/component": "identity", CLUSTER_NAME_LABEL: id.cluster}},
        "data": {"tls.crt": b64(&id.issuer_cert), "tls.key": b64(&id.issuer_key), "ca.crt": b64(&id.bundle)},
    }));
    // The gateways' shared QUIC stateless-reset secret (a new one per render).
    let mut reset_key = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut reset_key)
        .map_err(|_| anyhow::anyhow!("no system randomness for the gateway's reset key"))?;
    extra.push(json!({
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": GATEWAY_RESET_KEY_SECRET, "namespace": SYSTEM_NAMESPACE,
                     "labels": {"app.kubernetes.io/part-of": "strait", "app.kubernetes.io/component": "gateway", CLUSTER_NAME_LABEL: id.cluster}},
        "data": {"key": base64::engine::general_purpose::STANDARD.encode(reset_key)},
    }));
    objects.extend(extra);
    objects.sort_by_key(|o| kind_rank(o["kind"].as_str().unwrap_or("")));
    Ok(objects)
}

fn print(objects: &[Value], format: Format, header: &str) -> anyhow::Result<String> {
    Ok(match format {
        Format::Yaml => {
            let docs = objects
                .iter()
                .map(serde_yaml::to_string)
                .collect::<Result<Vec<_>, _>>()?;
            format!("{header}{}", docs.join("---\n"))
        }
        Format::Json => {
            serde_json::to_string_pretty(
                &json!({"apiVersion": "v1", "kind": "List", "items": objects}),
            )? + "\n"
        }
    })
}

pub fn install(args: InstallArgs) -> anyhow::Result<String> {
    if args.tag.is_empty() || args.registry.is_empty() {
        bail!("--registry and --tag must not be empty");
    }
    let id = load_identity(&args)?;
    let objects = render(&args, &id)?;
    let header = format!(
        "# strait install for cluster {} (strait {}): apply with `kubectl apply -f -`.\n# Holds the issuer's private key: do not store this output.\n",
        id.cluster,
        env!("CARGO_PKG_VERSION")
    );
    print(&objects, args.output, &header)
}

/// `namespace/name (cluster …)` of a Link, for the refusal.
fn describe(link: &Link) -> String {
    format!(
        "{}/{} (cluster {})",
        link.namespace().unwrap_or_default(),
        link.name_any(),
        link.spec.target_cluster_name
    )
}

pub async fn uninstall(args: UninstallArgs) -> anyhow::Result<String> {
    let kubeconfig = load_kubeconfig(&args.kubeconfig)?;
    let (client, _) = client_for(&kubeconfig, &args.context).await?;
    let links = match Api::<Link>::all(client.clone())
        .list(&ListParams::default())
        .await
    {
        Ok(list) => list.items,
        // No Link CRD: no Links.
        Err(kube::Error::Api(e)) if e.code == 404 => Vec::new(),
        Err(e) => {
            return Err(anyhow::Error::new(e).context(
                "cannot list the Links of this cluster, so uninstall cannot tell whether it would orphan them; check --context and your access",
            ));
        }
    };
    if !links.is_empty() {
        let names: Vec<String> = links.iter().map(describe).collect();
        bail!(
            "refusing to uninstall: {} Link(s) still exist: {}; remove each with `strait unlink --cluster-name <cluster>` first (deleting the CRD would delete them without removing their mirrors)",
            links.len(),
            names.join(", ")
        );
    }
    // Everything install makes, by reference only (no secrets in this output),
    // in reverse order: workloads first, the CRD and namespaces last. The MCS
    // API stays: it is shared, and deleting it would delete every ServiceExport.
    let mut objects = manifest_objects_of(MANIFESTS.iter().filter(|(path, _)| *path != MCS_CRDS))?;
    eprintln!(
        "note: the Multi-Cluster Services CRDs (ServiceExport, ServiceImport, ClusterProperty) are kept; remove them with `kubectl delete -f deploy/mcs/crds.yaml` once nothing uses them"
    );
    eprintln!(
        "note: CoreDNS's Corefile keeps the clusterset.local zone (`multicluster clusterset.local` in its kubernetes plugin); it answers only while ServiceImports exist, and may be removed by hand"
    );
    for ns in [SYSTEM_NAMESPACE, LINK_NAMESPACE] {
        objects.push(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": TRUST_ANCHORS_CONFIGMAP, "namespace": ns}}));
    }
    objects.push(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": ISSUER_SECRET, "namespace": SYSTEM_NAMESPACE}}));
    objects.push(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": GATEWAY_RESET_KEY_SECRET, "namespace": SYSTEM_NAMESPACE}}));
    // Access that `strait link` gave other clusters to this one (cluster-scoped: not
    // removed with the namespace).
    let link_accounts = Api::<ServiceAccount>::namespaced(client.clone(), LINK_NAMESPACE)
        .list_metadata(&ListParams::default().labels(CLUSTER_NAME_LABEL))
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    if !link_accounts.is_empty() {
        let clusters: Vec<String> = link_accounts
            .iter()
            .filter_map(|sa| sa.labels().get(CLUSTER_NAME_LABEL).cloned())
            .collect();
        eprintln!(
            "warning: other clusters link to this one as {}: their Links stop working; run `strait unlink` there",
            clusters.join(", ")
        );
    }
    for crb in Api::<ClusterRoleBinding>::all(client.clone())
        .list_metadata(&ListParams::default().labels(CLUSTER_NAME_LABEL))
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        if crb.name_any().starts_with("strait-link-") {
            objects.push(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": crb.name_any()}}));
        }
    }
    if Api::<ClusterRole>::all(client.clone())
        .get_metadata_opt(READER_ROLE)
        .await
        .ok()
        .flatten()
        .is_some()
    {
        objects.push(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": READER_ROLE}}));
    }
    objects.sort_by_key(|o| std::cmp::Reverse(kind_rank(o["kind"].as_str().unwrap_or(""))));
    let refs: Vec<Value> = objects
        .iter()
        .map(|o| {
            let mut metadata = json!({"name": o["metadata"]["name"]});
            if let Some(ns) = o["metadata"]["namespace"].as_str() {
                metadata["namespace"] = json!(ns);
            }
            json!({"apiVersion": o["apiVersion"], "kind": o["kind"], "metadata": metadata})
        })
        .collect();
    print(
        &refs,
        args.output,
        "# strait uninstall: delete with `kubectl delete -f -`.\n",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coredns_objects(configmap: &str) -> anyhow::Result<Vec<Value>> {
        let mut objects = manifest_objects()?;
        point_at_coredns(&mut objects, configmap)?;
        Ok(objects
            .into_iter()
            .filter(|o| {
                o["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.contains("coredns"))
            })
            .collect())
    }

    #[test]
    fn the_coredns_objects_follow_the_configmap_flag() {
        let default = coredns_objects("kube-system/coredns").unwrap();
        assert_eq!(default.len(), 4, "{default:#?}");
        let moved = coredns_objects("dns/my-dns").unwrap();
        let role = moved.iter().find(|o| o["kind"] == "Role").unwrap();
        assert_eq!(role["metadata"]["namespace"], "dns");
        assert_eq!(role["rules"][0]["resourceNames"], json!(["my-dns"]));
        let binding = moved.iter().find(|o| o["kind"] == "RoleBinding").unwrap();
        assert_eq!(binding["metadata"]["namespace"], "dns");
        let cluster_binding = moved
            .iter()
            .find(|o| o["kind"] == "ClusterRoleBinding")
            .unwrap();
        assert_eq!(
            cluster_binding["subjects"],
            json!([{"kind": "ServiceAccount", "name": "my-dns", "namespace": "dns"}])
        );
        assert!(coredns_objects("").unwrap().is_empty(), "off: none of them");
        let e = coredns_objects("coredns").unwrap_err().to_string();
        assert!(e.contains("not namespace/name"), "{e}");
    }
}
