//! `strait export svc/NAME` and `strait unexport svc/NAME`: set or clear the
//! export label that Links select (`strait.dev/exported=true` by default).

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use strait_mesh::names::EXPORT_LABEL;

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
    #[arg(long, default_value_t = format!("{EXPORT_LABEL}=true"))]
    pub label: String,
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
