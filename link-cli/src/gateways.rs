//! `strait gateways`: each linked cluster's gateway as this cluster's mirror
//! controller sees it: alive, how many services it carries, probe latency.

use std::path::PathBuf;

use kube::Api;
use serde::Serialize;
use strait_mesh::link::Link;

use crate::check::Output;
use crate::link::{LINK_NAMESPACE, client_for, load_kubeconfig};

#[derive(Debug, clap::Args)]
pub struct GatewaysArgs {
    /// Kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the cluster holding the Links.
    #[arg(long)]
    pub context: Option<String>,
    #[arg(short, long, value_enum, default_value = "text")]
    pub output: Output,
}

/// One row.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GatewayRow {
    pub cluster: String,
    /// "yes", "no" or "unknown" (not probed yet, or probing disabled).
    pub alive: String,
    pub num_services: u32,
    pub latency_p50_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
    /// Why, from the GatewayAlive condition.
    pub message: String,
}

pub fn row(link: &Link) -> GatewayRow {
    let status = link.status.clone().unwrap_or_default();
    let condition = status.conditions.iter().find(|c| c.type_ == "GatewayAlive");
    let alive = match condition.map(|c| c.status.as_str()) {
        Some("True") => "yes",
        Some("False") => "no",
        _ => "unknown",
    };
    GatewayRow {
        cluster: link.spec.target_cluster_name.clone(),
        alive: alive.into(),
        num_services: status.mirrored_services,
        latency_p50_ms: status.gateway_latency.as_ref().map(|l| l.p50_ms),
        latency_p99_ms: status.gateway_latency.as_ref().map(|l| l.p99_ms),
        message: condition.map(|c| c.message.clone()).unwrap_or_default(),
    }
}

fn ms(v: Option<f64>) -> String {
    v.map(|v| format!("{v}ms")).unwrap_or_else(|| "-".into())
}

pub fn table(rows: &[GatewayRow]) -> String {
    let mut lines = vec![[
        "CLUSTER".to_string(),
        "ALIVE".into(),
        "NUM_SVC".into(),
        "LATENCY (p50/p99)".into(),
    ]];
    for r in rows {
        let latency = match (r.latency_p50_ms, r.latency_p99_ms) {
            (None, None) => "-".to_string(),
            (p50, p99) => format!("{}/{}", ms(p50), ms(p99)),
        };
        lines.push([
            r.cluster.clone(),
            r.alive.clone(),
            r.num_services.to_string(),
            latency,
        ]);
    }
    crate::table::render(&lines)
}

pub async fn gateways(args: GatewaysArgs) -> anyhow::Result<String> {
    let kubeconfig = load_kubeconfig(&args.kubeconfig)?;
    let (client, _) = client_for(&kubeconfig, &args.context).await?;
    let links = Api::<Link>::namespaced(client, LINK_NAMESPACE)
        .list(&Default::default())
        .await
        .map_err(|e| anyhow::anyhow!("listing Links in {LINK_NAMESPACE}: {e} (is the Link CRD installed? `strait check` says)"))?;
    let mut rows: Vec<GatewayRow> = links.items.iter().map(row).collect();
    rows.sort_by(|a, b| a.cluster.cmp(&b.cluster));
    Ok(match args.output {
        Output::Json => serde_json::to_string_pretty(&rows)? + "\n",
        Output::Text if rows.is_empty() => format!("no Links in {LINK_NAMESPACE}\n"),
        Output::Text => table(&rows),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_come_from_link_status_and_render_as_a_table() {
        let link: Link = serde_json::from_value(serde_json::json!({
            "apiVersion": "multicluster.strait.dev/v1alpha1", "kind": "Link",
            "metadata": {"name": "west"},
            "spec": {"targetClusterName": "west", "clusterCredentialsSecret": "s"},
            "status": {"mirroredServices": 3,
                "gatewayLatency": {"p50Ms": 1.25, "p99Ms": 4.5, "samples": 20},
                "conditions": [{"type": "GatewayAlive", "status": "True", "reason": "ProbeSucceeded",
                    "message": "1 gateway address(es) answer the probe", "lastTransitionTime": "2025-01-01T00:00:00Z"}]},
        }))
        .unwrap();
        let r = row(&link);
        assert_eq!(
            (r.alive.as_str(), r.num_services, r.latency_p50_ms),
            ("yes", 3, Some(1.25))
        );
        let mut new: Link = link.clone();
        new.spec.target_cluster_name = "north-long-name".into();
        new.status = None;
        let text = table(&[r, row(&new)]);
        assert_eq!(
            text,
            "CLUSTER           ALIVE     NUM_SVC   LATENCY (p50/p99)\n\
             west              yes       3         1.25ms/4.5ms\n\
             north-long-name   unknown   0         -\n"
        );
    }
}
