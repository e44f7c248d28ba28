//! `strait export svc/NAME` and `strait unexport svc/NAME`: set or clear the
//! export label that Links select (`strait.dev/exported=true` by default), or
//! with `--clusterset` create or delete the MCS API's ServiceExport.

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use strait_mesh::mcs::{MCS_GROUP, ServiceExport};
use strait_mesh::names::{CLUSTERSET_DOMAIN, EXPORT_LABEL};

use crate::link::{client_for, load_kubeconfig};

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// The Service, as svc/NAME (also service/NAME, services/NAME).
    pub target: String,
    /// Namespace of the Service (default: the context's, else "default").
    #[arg(short, long)]
    pub namespace: Option<String>,
    /// Kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the cluster the Service lives in (the exporting cluster).
    #[arg(long)]
    pub context: Option<String>,
    /// The export label as KEY=VALUE, for a Link with another selector
    /// (e.g. mirror.linkerd.io/exported=true). Unexport needs only the KEY.
    #[arg(long, default_value_t = format!("{EXPORT_LABEL}=true"), conflicts_with = "clusterset")]
    pub label: String,
    /// Export to the whole clusterset with the Multi-Cluster Services API: a
    /// ServiceExport of the same name, from which every linked cluster makes
    /// one ServiceImport, `<svc>.<ns>.svc.clusterset.local`, served by every
    /// cluster that exports it (instead of a `<svc>-<cluster>` mirror).
    #[arg(long)]
    pub clusterset: bool,
}

/// `svc/web` → `web`, with an error saying what form is wanted.
pub fn parse_target(target: &str) -> anyhow::Result<String> {
    let Some((kind, name)) = target.split_once('/') else {
        bail!("{target:?}: expected svc/NAME, e.g. `strait export svc/web -n shop`");
    };
    if !matches!(kind, "svc" | "service" | "services") {
        bail!("{target:?}: only Services can be exported; write svc/NAME");
    }
    let valid = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if !valid {
        bail!("{name:?} is not a Service name (lower-case letters, digits and '-', at most 63)");
    }
    Ok(name.to_string())
}

/// `key=value` (or only `key` when `value_optional`).
pub fn parse_label(label: &str, value_optional: bool) -> anyhow::Result<(String, Option<String>)> {
    let (key, value) = match label.split_once('=') {
        Some((k, v)) => (k, Some(v.to_string())),
        None if value_optional => (label, None),
        None => {
            bail!("--label {label:?}: expected KEY=VALUE, e.g. mirror.linkerd.io/exported=true")
        }
    };
    let name = key.rsplit('/').next().unwrap_or_default();
    if key.is_empty()
        || name.is_empty()
        || key.contains(char::is_whitespace)
        || key.matches('/').count() > 1
    {
        bail!("--label {label:?}: {key:?} is not a label key");
    }
    if value
        .as_deref()
        .is_some_and(|v| v.is_empty() || v.contains(char::is_whitespace))
    {
        bail!("--label {label:?}: the value must be a non-empty label value");
    }
    Ok((key.to_string(), value))
}

async fn service_api(args: &ExportArgs) -> anyhow::Result<(Api<Service>, String, String)> {
    let name = parse_target(&args.target)?;
    let kubeconfig = load_kubeconfig(&args.kubeconfig)?;
    let (client, config) = client_for(&kubeconfig, &args.context).await?;
    let ns = args.namespace.clone().unwrap_or(config.default_namespace);
    let api: Api<Service> = Api::namespaced(client, &ns);
    let found = api
        .get_metadata_opt(&name)
        .await
        .with_context(|| format!("reading Service {ns}/{name}"))?;
    if found.is_none() {
        bail!(
            "no Service {ns}/{name} in context {:?}: check the name, -n/--namespace and --context",
            args.context.as_deref().unwrap_or("(current)")
        );
    }
    Ok((api, ns, name))
}

pub async fn export(args: ExportArgs) -> anyhow::Result<String> {
    if args.clusterset {
        return export_clusterset(&args).await;
    }
    let (key, value) = parse_label(&args.label, false)?;
    let (api, ns, name) = service_api(&args).await?;
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {&key: value}}})),
    )
    .await
    .with_context(|| format!("labelling Service {ns}/{name}"))?;
    Ok(format!(
        "service {ns}/{name} exported ({key}={}): linked clusters selecting it will mirror it as {name}-<this cluster>\n",
        value.unwrap_or_default()
    ))
}

pub async fn unexport(args: ExportArgs) -> anyhow::Result<String> {
    if args.clusterset {
        return unexport_clusterset(&args).await;
    }
    let (key, _) = parse_label(&args.label, true)?;
    let (api, ns, name) = service_api(&args).await?;
    let current = api.get_metadata(&name).await?;
    if !current.labels().contains_key(&key) {
        return Ok(format!(
            "service {ns}/{name} was not exported (no label {key})\n"
        ));
    }
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {&key: null}}})),
    )
    .await
    .with_context(|| format!("removing label {key} from Service {ns}/{name}"))?;
    Ok(format!(
        "service {ns}/{name} unexported (label {key} removed): linked clusters remove its mirrors\n"
    ))
}

/// Fails with what to do when the cluster does not serve ServiceExports.
async fn ensure_mcs_api(client: &kube::Client) -> anyhow::Result<()> {
    let served = match client
        .list_api_group_resources(&format!("{MCS_GROUP}/v1beta1"))
        .await
    {
        Ok(list) => list.resources.iter().any(|r| r.name == "serviceexports"),
        Err(kube::Error::Api(e)) if e.code == 404 => false,
        Err(e) => return Err(anyhow::Error::new(e).context("reading the cluster's APIs")),
    };
    if !served {
        bail!(
            "this cluster does not serve ServiceExports ({MCS_GROUP}/v1beta1): install Strait with `strait install` (or `kubectl apply -f deploy/mcs/crds.yaml`)"
        );
    }
    Ok(())
}

async fn export_clusterset(args: &ExportArgs) -> anyhow::Result<String> {
    let (services, ns, name) = service_api(args).await?;
    let service = services.get(&name).await?;
    if service.spec.as_ref().and_then(|s| s.type_.as_deref()) == Some("ExternalName") {
        bail!(
            "Service {ns}/{name} is of type ExternalName, which the MCS API cannot export (it has no endpoints); export a ClusterIP or headless Service"
        );
    }
    let client = services.into_client();
    ensure_mcs_api(&client).await?;
    let exports: Api<ServiceExport> = Api::namespaced(client, &ns);
    let export = ServiceExport::new(&name, Default::default());
    match exports.create(&PostParams::default(), &export).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {
            return Ok(format!(
                "service {ns}/{name} is already exported to the clusterset (ServiceExport {ns}/{name})\n"
            ));
        }
        Err(e) => {
            return Err(
                anyhow::Error::new(e).context(format!("creating ServiceExport {ns}/{name}"))
            );
        }
    }
    Ok(format!(
        "service {ns}/{name} exported to the clusterset (ServiceExport {ns}/{name}): every linked cluster serves it as {name}.{ns}.svc.{CLUSTERSET_DOMAIN}; see `kubectl get serviceexport {name} -n {ns} -o yaml` for its conditions\n"
    ))
}

async fn unexport_clusterset(args: &ExportArgs) -> anyhow::Result<String> {
    let name = parse_target(&args.target)?;
    let kubeconfig = load_kubeconfig(&args.kubeconfig)?;
    let (client, config) = client_for(&kubeconfig, &args.context).await?;
    let ns = args.namespace.clone().unwrap_or(config.default_namespace);
    ensure_mcs_api(&client).await?;
    let exports: Api<ServiceExport> = Api::namespaced(client, &ns);
    match exports.delete(&name, &Default::default()).await {
        Ok(_) => Ok(format!(
            "service {ns}/{name} no longer exported to the clusterset (ServiceExport deleted): clusters drop this cluster's endpoints from {name}.{ns}.svc.{CLUSTERSET_DOMAIN}\n"
        )),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(format!(
            "service {ns}/{name} was not exported to the clusterset (no ServiceExport {ns}/{name})\n"
        )),
        Err(e) => Err(anyhow::Error::new(e).context(format!("deleting ServiceExport {ns}/{name}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_must_be_services() {
        assert_eq!(parse_target("svc/web").unwrap(), "web");
        assert_eq!(parse_target("service/web-2").unwrap(), "web-2");
        assert!(
            parse_target("web")
                .unwrap_err()
                .to_string()
                .contains("expected svc/NAME")
        );
        assert!(
            parse_target("deploy/web")
                .unwrap_err()
                .to_string()
                .contains("only Services")
        );
        assert!(
            parse_target("svc/Web")
                .unwrap_err()
                .to_string()
                .contains("not a Service name")
        );
        assert!(parse_target("svc/").is_err());
    }

    #[test]
    fn labels_parse() {
        assert_eq!(
            parse_label("strait.dev/exported=true", false).unwrap(),
            ("strait.dev/exported".into(), Some("true".into()))
        );
        assert_eq!(
            parse_label("mirror.linkerd.io/exported", true).unwrap(),
            ("mirror.linkerd.io/exported".into(), None)
        );
        assert!(parse_label("mirror.linkerd.io/exported", false).is_err());
        assert!(parse_label("a/b/c=true", false).is_err());
        assert!(parse_label("=true", false).is_err());
        assert!(parse_label("k=", false).is_err());
    }
}
