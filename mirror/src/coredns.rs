//! Cluster DNS for the clusterset: `<svc>.<ns>.svc.clusterset.local` from
//! every pod, meshed or not.
//!
//! CoreDNS (1.12.2 and later, the default since Kubernetes 1.35) answers the
//! MCS names itself: its `kubernetes` plugin, given the zone and
//! `multicluster <zone>`, reads ServiceImports (ClusterSetIP: `spec.ips`) and
//! the EndpointSlices labelled `multicluster.kubernetes.io/service-name`
//! (headless: the endpoints, and `<hostname>.<cluster>.<svc>…`). The
//! controller adds both to the Corefile in CoreDNS's ConfigMap (as Cilium's
//! clustermesh does) and keeps them there: a kubeadm upgrade that rewrites
//! the ConfigMap is corrected at the next check. CoreDNS's `reload` plugin
//! (in kubeadm's and kind's Corefile) loads the change; without it the log
//! says to restart CoreDNS. The controller touches nothing but the one
//! ConfigMap it is given (RBAC: get and update on that name only).

use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::PostParams;
use kube::{Api, Client};

/// How often the Corefile is checked (and restored if something rewrote it).
pub const RECHECK: Duration = Duration::from_secs(60);

/// The Corefile with `zone` served by every `kubernetes` plugin block as a
/// multicluster zone, or `None` when it already is. An error when there is
/// no `kubernetes` plugin to extend.
pub fn with_multicluster_zone(corefile: &str, zone: &str) -> Result<Option<String>, String> {
    let zone = zone.trim_end_matches('.');
    let same = |token: &str| token.trim_end_matches('.').eq_ignore_ascii_case(zone);
    let lines: Vec<&str> = corefile.lines().collect();
    let mut out: Vec<String> = Vec::with_capacity(lines.len() + 2);
    let mut found = false;
    let mut changed = false;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let mut tokens: Vec<&str> = trimmed.split_whitespace().collect();
        if tokens.first() != Some(&"kubernetes") {
            out.push(line.to_string());
            i += 1;
            continue;
        }
        found = true;
        let opens = tokens.last() == Some(&"{");
        if opens {
            tokens.pop();
        }
        if tokens.len() < 2 {
            return Err("its kubernetes plugin names no zones (it serves its server block's): name them, e.g. `kubernetes cluster.local in-addr.arpa ip6.arpa`".into());
        }
        if !tokens[1..].iter().any(|t| same(t)) {
            // After the first zone (the cluster domain), before reverse zones.
            tokens.insert(2, zone);
            changed = true;
        }
        let head = format!("{indent}{}", tokens.join(" "));
        if !opens {
            out.push(format!("{head} {{"));
            out.push(format!("{indent}    multicluster {zone}"));
            out.push(format!("{indent}}}"));
            changed = true;
            i += 1;
            continue;
        }
        out.push(format!("{head} {{"));
        // The block's lines, up to its closing brace.
        let start = i + 1;
        let mut depth = 1usize;
        let mut end = start;
        while end < lines.len() {
            let t = lines[end].trim();
            depth += t.matches('{').count();
            depth -= t.matches('}').count().min(depth);
            if depth == 0 {
                break;
            }
            end += 1;
        }
        if end == lines.len() {
            return Err("the kubernetes plugin's block is never closed".into());
        }
        let body = &lines[start..end];
        let inner_indent = body
            .iter()
            .find(|l| !l.trim().is_empty())
            .map(|l| l[..l.len() - l.trim_start().len()].to_string())
            .unwrap_or_else(|| format!("{indent}    "));
        let multicluster = body
            .iter()
            .position(|l| l.split_whitespace().next() == Some("multicluster"));
        match multicluster {
            Some(at) if body[at].split_whitespace().skip(1).any(same) => {
                out.extend(body.iter().map(|l| l.to_string()));
            }
            Some(at) => {
                for (n, l) in body.iter().enumerate() {
                    if n == at {
                        out.push(format!("{} {zone}", l.trim_end()));
                    } else {
                        out.push(l.to_string());
                    }
                }
                changed = true;
            }
            None => {
                out.push(format!("{inner_indent}multicluster {zone}"));
                out.extend(body.iter().map(|l| l.to_string()));
                changed = true;
            }
        }
        out.push(lines[end].to_string());
        i = end + 1;
    }
    if !found {
        return Err(
            "it has no kubernetes plugin (the one serving the cluster domain) to extend".into(),
        );
    }
    if !changed {
        return Ok(None);
    }
    let mut text = out.join("\n");
    if corefile.ends_with('\n') {
        text.push('\n');
    }
    Ok(Some(text))
}

/// Keeps `zone` in the Corefile of ConfigMap `namespace/name`, checking
/// every [`RECHECK`]. Never returns; every failure is logged with what to do
/// and retried at the next check.
pub async fn keep_configured(client: Client, namespace: String, name: String, zone: String) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let mut said = None::<String>;
    loop {
        let outcome = configure_once(&api, &namespace, &name, &zone).await;
        let text = match &outcome {
            Ok(Some(note)) => Some(note.clone()),
            Ok(None) => None,
            Err(e) => Some(e.clone()),
        };
        // Each distinct state once, not every minute.
        if text != said {
            match &outcome {
                Ok(Some(note)) => tracing::info!("{note}"),
                Ok(None) => {}
                Err(e) => tracing::warn!("{e}"),
            }
            said = text;
        }
        tokio::time::sleep(RECHECK).await;
    }
}

/// One check: `Ok(Some(what was done))`, `Ok(None)` when it was in place.
async fn configure_once(
    api: &Api<ConfigMap>,
    namespace: &str,
    name: &str,
    zone: &str,
) -> Result<Option<String>, String> {
    let where_ = format!("ConfigMap {namespace}/{name}");
    // A conflict (someone wrote in between) is tried again at once, a few times.
    for _ in 0..5 {
        let Some(mut cm) = api
            .get_opt(name)
            .await
            .map_err(|e| format!("cluster DNS for {zone}: reading {where_}: {e}"))?
        else {
            return Err(format!(
                "cluster DNS for {zone}: there is no {where_}: {zone} names resolve only through Strait's node proxies (transparent pods); point --coredns-configmap at your CoreDNS ConfigMap, or add `{zone}` and `multicluster {zone}` to its kubernetes plugin by hand"
            ));
        };
        let corefile = cm
            .data
            .as_ref()
            .and_then(|d| d.get("Corefile"))
            .cloned()
            .ok_or_else(|| format!("cluster DNS for {zone}: {where_} holds no Corefile"))?;
        let Some(updated) = with_multicluster_zone(&corefile, zone)
            .map_err(|e| format!("cluster DNS for {zone}: the Corefile in {where_}: {e}: add `{zone}` and `multicluster {zone}` to the plugin serving the cluster domain by hand"))?
        else {
            return Ok(None);
        };
        let reloads = corefile
            .lines()
            .any(|l| l.split_whitespace().next() == Some("reload"));
        cm.data
            .get_or_insert_default()
            .insert("Corefile".into(), updated);
        match api.replace(name, &PostParams::default(), &cm).await {
            Ok(_) if reloads => {
                return Ok(Some(format!(
                    "cluster DNS: {where_} now serves {zone} (CoreDNS's reload plugin loads it within its interval)"
                )));
            }
            Ok(_) => {
                return Ok(Some(format!(
                    "cluster DNS: {where_} now serves {zone}, but its Corefile has no reload plugin: restart CoreDNS (kubectl -n {namespace} rollout restart deployment/{name}) for it to take effect"
                )));
            }
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(format!("cluster DNS for {zone}: writing {where_}: {e}")),
        }
    }
    Err(format!(
        "cluster DNS for {zone}: {where_} kept changing while it was written; trying again later"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBEADM: &str = ".:53 {
    errors
    health {
       lameduck 5s
    }
    ready
    kubernetes cluster.local in-addr.arpa ip6.arpa {
       pods insecure
       fallthrough in-addr.arpa ip6.arpa
       ttl 30
    }
    prometheus :9153
    forward . /etc/resolv.conf {
       max_concurrent 1000
    }
    cache 30
    loop
    reload
    loadbalance
}
";

    #[test]
    fn kubeadms_corefile_gets_the_zone_and_the_multicluster_option() {
        let out = with_multicluster_zone(KUBEADM, "clusterset.local")
            .unwrap()
            .unwrap();
        assert!(
            out.contains(
                "    kubernetes cluster.local clusterset.local in-addr.arpa ip6.arpa {\n       multicluster clusterset.local\n       pods insecure\n"
            ),
            "{out}"
        );
        // Nothing else moved.
        assert_eq!(out.lines().count(), KUBEADM.lines().count() + 1);
        assert!(out.ends_with("}\n"));
        assert!(out.contains("forward . /etc/resolv.conf {\n       max_concurrent 1000\n    }"));
    }

    #[test]
    fn a_configured_corefile_is_left_alone() {
        let once = with_multicluster_zone(KUBEADM, "clusterset.local")
            .unwrap()
            .unwrap();
        assert_eq!(with_multicluster_zone(&once, "clusterset.local"), Ok(None));
        assert_eq!(with_multicluster_zone(&once, "clusterset.local."), Ok(None));
    }

    #[test]
    fn an_existing_multicluster_line_gains_the_zone() {
        let corefile = ".:53 {\n  kubernetes cluster.local other.local {\n    multicluster other.local\n  }\n}";
        let out = with_multicluster_zone(corefile, "clusterset.local")
            .unwrap()
            .unwrap();
        assert_eq!(
            out,
            ".:53 {\n  kubernetes cluster.local clusterset.local other.local {\n    multicluster other.local clusterset.local\n  }\n}"
        );
    }

    #[test]
    fn a_kubernetes_plugin_without_a_block_gets_one() {
        let out = with_multicluster_zone(
            ".:53 {\n    kubernetes cluster.local\n}\n",
            "clusterset.local",
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            out,
            ".:53 {\n    kubernetes cluster.local clusterset.local {\n        multicluster clusterset.local\n    }\n}\n"
        );
    }

    #[test]
    fn a_corefile_without_the_kubernetes_plugin_is_an_error() {
        let e = with_multicluster_zone(".:53 {\n    forward . 8.8.8.8\n}\n", "clusterset.local")
            .unwrap_err();
        assert!(e.contains("no kubernetes plugin"), "{e}");
        let e = with_multicluster_zone(
            ".:53 {\n    kubernetes cluster.local {\n      pods insecure\n",
            "x",
        )
        .unwrap_err();
        assert!(e.contains("never closed"), "{e}");
    }
}
