//! `strait identity rotate`: move one cluster's trust-anchor bundle (and, with
//! `--issuer-dir`, its issuer) one step along a rotation, refusing any step that
//! would break mutual TLS in that cluster.
//!
//! A rotation is three runs per cluster, each on every cluster before the next:
//! 1. `--trust-anchors old+new`: everyone trusts both, nothing re-issued yet;
//! 2. `--trust-anchors new+old --issuer-dir DIR` (an issuer signed by `new`): the
//!    active (first) anchor changes, so every component re-fetches its certificate
//!    under it (`identity_cert_chains_to_active_anchor` → 1);
//! 3. `--trust-anchors new`: the old anchor is gone.
//!
//! The one invariant checked: after the step, the issuer chains to the bundle's
//! **active** anchor (otherwise every refreshed certificate would be re-fetched
//! in a loop, or fail). Besides: a new issuer must be for the same trust domain,
//! and signed by an anchor the cluster already trusts (step 1 done); the anchor
//! that is active now is never dropped (certificates in use chain to it).
//! `--force` skips the last two, not the invariant.

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use base64::Engine as _;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;
use kube::api::{Patch, PatchParams};
use rustls::pki_types::UnixTime;
use serde_json::json;
use strait_mesh::identity::ca::PemPair;
use strait_mesh::identity::certs;
use strait_mesh::identity::trust::{Constraints, fingerprint};
use strait_mesh::link::TRUST_ANCHORS_CONFIGMAP;
use strait_mesh::names::{LINK_NAMESPACE, SYSTEM_NAMESPACE};

use crate::check::local::signed_by;
use crate::install::ISSUER_SECRET;
use crate::link::{client_for, load_kubeconfig};

#[derive(Debug, clap::Args)]
pub struct RotateArgs {
    /// The new trust-anchor bundle (PEM roots). Its first anchor becomes the active one:
    /// the one every certificate must chain to.
    #[arg(long)]
    pub trust_anchors: PathBuf,
    /// A re-issued issuer to install with the bundle: the folder written by
    /// `strait identity issuer --out-dir DIR` (issuer.crt, issuer.key).
    #[arg(long)]
    pub issuer_dir: Option<PathBuf>,
    /// Kubeconfig file (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the cluster to rotate.
    #[arg(long)]
    pub context: Option<String>,
    /// Check and print the step, write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Allow a step out of order (an issuer under an anchor the cluster does not trust
    /// yet, or dropping the active anchor). Never allows an issuer outside the bundle's
    /// active anchor.
    #[arg(long)]
    pub force: bool,
}

/// What the cluster has now.
pub struct Current {
    pub bundle_pem: String,
    pub issuer_cert_pem: String,
}

/// One checked rotation step.
#[derive(Debug)]
pub struct Step {
    pub bundle_pem: String,
    pub issuer: Option<PemPair>,
    pub report: Vec<String>,
}

fn short(der: &[u8]) -> String {
    fingerprint(der)[..16].to_string()
}

fn names(ders: &[Vec<u8>]) -> String {
    ders.iter().map(|d| short(d)).collect::<Vec<_>>().join(", ")
}

fn ders(what: &str, pem: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    Ok(certs::parse_certs(what, pem.as_bytes())?
        .into_iter()
        .map(|d| d.to_vec())
        .collect())
}

/// Checks one step; pure, so every refusal is unit-tested.
pub fn plan(
    current: &Current,
    bundle_pem: &str,
    new_issuer: Option<PemPair>,
    force: bool,
    now: UnixTime,
) -> anyhow::Result<Step> {
    let bundle = ders("new trust-anchor bundle", bundle_pem)?;
    for (i, der) in bundle.iter().enumerate() {
        let info = certs::inspect(&format!("anchor #{}", i + 1), der)?;
        if !info.is_ca || !info.self_signed {
            bail!(
                "anchor #{} of the new bundle ({}) is not a self-signed CA: a bundle holds trust anchors only (strait identity trust-anchor), not issuers or leaves",
                i + 1,
                info.subject
            );
        }
        let secs = now.as_secs() as i64;
        if secs < info.not_before_unix || secs > info.not_after_unix {
            bail!(
                "anchor #{} of the new bundle ({}) is not valid now ({} → {})",
                i + 1,
                info.subject,
                info.not_before,
                info.not_after
            );
        }
    }
    let mut unique = bundle.clone();
    unique.sort();
    unique.dedup();
    if unique.len() != bundle.len() {
        bail!("the new bundle lists one anchor twice: list each once, the active one first");
    }
    let old = ders("the cluster's strait-trust-anchors", &current.bundle_pem)?;
    let current_issuer = ders("the cluster's issuer (tls.crt)", &current.issuer_cert_pem)?;
    let current_issuer = &current_issuer[0];
    let active = &bundle[0];
    let mut report = vec![format!(
        "trust anchors: [{}] → [{}] (active first)",
        names(&old),
        names(&bundle)
    )];

    let issuer_der = match &new_issuer {
        Some(pair) => {
            let der = ders("new issuer (issuer.crt)", &pair.cert_pem)?.remove(0);
            let anchors: Vec<_> = bundle
                .iter()
                .map(|d| rustls::pki_types::CertificateDer::from(d.as_slice()))
                .collect();
            certs::validate_issuer("new issuer", &der, &pair.key_pem, &anchors, now)
                .context("the new issuer cannot sign under the new bundle")?;
            let domain = |der: &[u8], what: &str| -> anyhow::Result<Option<String>> {
                Ok(Constraints::of_issuer(der)
                    .map_err(|e| anyhow::anyhow!("{what}: {e}"))?
                    .trust_domain()
                    .map(str::to_string))
            };
            let (was, will) = (
                domain(current_issuer, "current issuer")?,
                domain(&der, "new issuer")?,
            );
            if was != will {
                bail!(
                    "the new issuer is for trust domain {} but this cluster's is {}: strait-identity refuses to switch trust domains live; re-issue for {} (strait identity issuer --trust-domain), or migrate with strait install",
                    will.as_deref().unwrap_or("(any: no name constraint)"),
                    was.as_deref().unwrap_or("(any: no name constraint)"),
                    was.as_deref().unwrap_or("the same trust domain"),
                );
            }
            let signer = signed_by(&der, &bundle);
            if !signer.is_some_and(|i| old.contains(&bundle[i])) && !force {
                bail!(
                    "the new issuer is signed by an anchor this cluster does not trust yet: first ship a bundle with both anchors to every cluster (strait identity rotate --trust-anchors old+new), wait until every pod has it (kubelet syncs mounted ConfigMaps within about a minute), then re-issue (--force skips this check)"
                );
            }
            report.push(format!(
                "issuer: re-issued under {} (trust domain {})",
                short(&bundle[signer.unwrap_or(0)]),
                will.as_deref().unwrap_or("any")
            ));
            der
        }
        None => {
            report.push("issuer: unchanged".to_string());
            current_issuer.clone()
        }
    };
    match signed_by(&issuer_der, &bundle) {
        Some(0) => {}
        Some(i) => bail!(
            "the issuer is signed by anchor #{} ({}), not by the active (first) one ({}): every certificate it signs would be re-fetched in a loop; put its anchor first, or re-issue it under {} and pass --issuer-dir",
            i + 1,
            short(&bundle[i]),
            short(active),
            short(active)
        ),
        None => bail!(
            "the issuer (signed by {}) chains to no anchor of the new bundle: every workload's certificate would be refused; keep its anchor in the bundle (first), or re-issue it under the new anchor and pass --issuer-dir",
            certs::issuer_name(&issuer_der).unwrap_or_default()
        ),
    }
    if let Some(was_active) = old.first()
        && !bundle.contains(was_active)
        && !force
    {
        bail!(
            "the new bundle drops {}, the anchor active now: certificates in use chain to it; first make the new anchor active (--trust-anchors new+old --issuer-dir DIR) and wait for identity_cert_chains_to_active_anchor to be 1 on every component of every cluster (--force skips this check)",
            short(was_active)
        );
    }
    let dropped: Vec<Vec<u8>> = old
        .iter()
        .filter(|d| !bundle.contains(d))
        .cloned()
        .collect();
    report.push(if old.first() != Some(active) {
        "next: watch identity_cert_chains_to_active_anchor reach 1 on every component of every cluster, then drop the old anchor: strait identity rotate --trust-anchors <new anchor only>".to_string()
    } else if bundle.len() > 1 {
        "next: ship this bundle to every linked cluster, wait about a minute for pods to see it, then re-issue each issuer under the new anchor: strait identity rotate --trust-anchors new+old --issuer-dir DIR".to_string()
    } else if !dropped.is_empty() {
        format!(
            "rotation finished here: no longer trusted: [{}]",
            names(&dropped)
        )
    } else {
        "nothing to rotate: one anchor, the issuer under it".to_string()
    });
    Ok(Step {
        bundle_pem: bundle_pem.to_string(),
        issuer: new_issuer,
        report,
    })
}

fn read(path: &std::path::Path, what: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path)
        .with_context(|| format!("read the {what} from {}", path.display()))
}

pub async fn rotate(args: RotateArgs) -> anyhow::Result<String> {
    let bundle_pem = read(&args.trust_anchors, "trust-anchor bundle")?;
    let new_issuer = match &args.issuer_dir {
        Some(dir) => Some(PemPair {
            cert_pem: read(&dir.join("issuer.crt"), "issuer certificate")?,
            key_pem: read(&dir.join("issuer.key"), "issuer key")?,
        }),
        None => None,
    };
    let kubeconfig = load_kubeconfig(&args.kubeconfig)?;
    let (client, _) = client_for(&kubeconfig, &args.context).await?;
    let not_installed = "is Strait installed in this cluster? (strait install)";
    let anchors = Api::<ConfigMap>::namespaced(client.clone(), SYSTEM_NAMESPACE)
        .get(TRUST_ANCHORS_CONFIGMAP)
        .await
        .with_context(|| {
            format!("reading {SYSTEM_NAMESPACE}/{TRUST_ANCHORS_CONFIGMAP}: {not_installed}")
        })?;
    let secrets = Api::<Secret>::namespaced(client.clone(), SYSTEM_NAMESPACE);
    // Only the certificate is read: the current key never leaves the cluster.
    let issuer = secrets
        .get(ISSUER_SECRET)
        .await
        .with_context(|| format!("reading {SYSTEM_NAMESPACE}/{ISSUER_SECRET}: {not_installed}"))?;
    let issuer_cert = issuer
        .data
        .unwrap_or_default()
        .remove("tls.crt")
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        .with_context(|| format!("{SYSTEM_NAMESPACE}/{ISSUER_SECRET} has no tls.crt"))?;
    let current = Current {
        bundle_pem: anchors
            .data
            .unwrap_or_default()
            .remove("ca.crt")
            .unwrap_or_default(),
        issuer_cert_pem: issuer_cert,
    };
    let step = plan(
        &current,
        &bundle_pem,
        new_issuer,
        args.force,
        UnixTime::now(),
    )?;
    let mut out = step.report.join("\n") + "\n";
    if args.dry_run {
        return Ok(out + "dry run: nothing written\n");
    }
    // The bundle first, everywhere it is mounted, so that nothing signed by a new
    // issuer reaches a component that does not trust it yet; the issuer last.
    let params = PatchParams::default();
    for ns in [SYSTEM_NAMESPACE, LINK_NAMESPACE] {
        Api::<ConfigMap>::namespaced(client.clone(), ns)
            .patch(
                TRUST_ANCHORS_CONFIGMAP,
                &params,
                &Patch::Merge(json!({"data": {"ca.crt": step.bundle_pem}})),
            )
            .await
            .with_context(|| {
                format!("writing {ns}/{TRUST_ANCHORS_CONFIGMAP} (nothing after it was written; run the same command again)")
            })?;
        out += &format!("wrote ConfigMap {ns}/{TRUST_ANCHORS_CONFIGMAP}\n");
    }
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let mut data = json!({"ca.crt": b64(&step.bundle_pem)});
    if let Some(pair) = &step.issuer {
        data["tls.crt"] = b64(&pair.cert_pem).into();
        data["tls.key"] = b64(&pair.key_pem).into();
    }
    secrets
        .patch(ISSUER_SECRET, &params, &Patch::Merge(json!({"data": data})))
        .await
        .with_context(|| {
            format!("writing {SYSTEM_NAMESPACE}/{ISSUER_SECRET} (the bundles were written; run the same command again)")
        })?;
    out += &format!(
        "wrote Secret {SYSTEM_NAMESPACE}/{ISSUER_SECRET} ({})\n",
        if step.issuer.is_some() {
            "issuer and ca.crt"
        } else {
            "ca.crt"
        }
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use strait_mesh::identity::ca;

    const DAY: Duration = Duration::from_secs(86_400);

    struct World {
        old: PemPair,
        new: PemPair,
        old_issuer: PemPair,
        new_issuer: PemPair,
    }

    fn world() -> World {
        let old = ca::new_trust_anchor("old anchor", 30 * DAY).unwrap();
        let new = ca::new_trust_anchor("new anchor", 30 * DAY).unwrap();
        let td = Some("east.clusterset.local");
        World {
            old_issuer: ca::new_issuer(&old, "east", td, 10 * DAY).unwrap(),
            new_issuer: ca::new_issuer(&new, "east", td, 10 * DAY).unwrap(),
            old,
            new,
        }
    }

    fn current(bundle: &[&PemPair], issuer: &PemPair) -> Current {
        Current {
            bundle_pem: bundle.iter().map(|p| p.cert_pem.as_str()).collect(),
            issuer_cert_pem: issuer.cert_pem.clone(),
        }
    }

    fn bundle(anchors: &[&PemPair]) -> String {
        anchors.iter().map(|p| p.cert_pem.as_str()).collect()
    }

    fn step(
        cur: &Current,
        anchors: &[&PemPair],
        issuer: Option<&PemPair>,
        force: bool,
    ) -> anyhow::Result<Step> {
        plan(
            cur,
            &bundle(anchors),
            issuer.cloned(),
            force,
            UnixTime::now(),
        )
    }

    fn refusal(r: anyhow::Result<Step>) -> String {
        format!("{:#}", r.expect_err("the step must be refused"))
    }

    #[test]
    fn the_three_steps_in_order_pass() {
        let w = world();
        let s1 = step(
            &current(&[&w.old], &w.old_issuer),
            &[&w.old, &w.new],
            None,
            false,
        )
        .unwrap();
        assert!(s1.issuer.is_none());
        assert!(
            s1.report.last().unwrap().contains("re-issue"),
            "{:?}",
            s1.report
        );
        let s2 = step(
            &current(&[&w.old, &w.new], &w.old_issuer),
            &[&w.new, &w.old],
            Some(&w.new_issuer),
            false,
        )
        .unwrap();
        assert_eq!(s2.issuer.as_ref().unwrap().cert_pem, w.new_issuer.cert_pem);
        assert!(
            s2.report
                .last()
                .unwrap()
                .contains("identity_cert_chains_to_active_anchor")
        );
        let s3 = step(
            &current(&[&w.new, &w.old], &w.new_issuer),
            &[&w.new],
            None,
            false,
        )
        .unwrap();
        assert!(
            s3.report.last().unwrap().contains("finished"),
            "{:?}",
            s3.report
        );
    }

    #[test]
    fn steps_that_would_break_mtls_are_refused_saying_what_to_do() {
        let w = world();
        // Issuer not in the bundle at all.
        let e = refusal(step(
            &current(&[&w.old], &w.old_issuer),
            &[&w.new],
            None,
            true,
        ));
        assert!(e.contains("chains to no anchor"), "{e}");
        // Issuer under a non-active anchor (the documented step 2 with the old order).
        let e = refusal(step(
            &current(&[&w.old, &w.new], &w.old_issuer),
            &[&w.old, &w.new],
            Some(&w.new_issuer),
            true,
        ));
        assert!(e.contains("not by the active (first) one"), "{e}");
        // New issuer under an anchor the cluster does not trust yet: refused, --force allows.
        let cur = current(&[&w.old], &w.old_issuer);
        let e = refusal(step(&cur, &[&w.new, &w.old], Some(&w.new_issuer), false));
        assert!(e.contains("does not trust yet"), "{e}");
        step(&cur, &[&w.new, &w.old], Some(&w.new_issuer), true).unwrap();
        // Dropping the anchor active now.
        let cur = current(&[&w.old, &w.new], &w.old_issuer);
        let e = refusal(step(&cur, &[&w.new], Some(&w.new_issuer), false));
        assert!(e.contains("drops"), "{e}");
        // Another trust domain.
        let west = ca::new_issuer(&w.new, "west", Some("west.clusterset.local"), DAY).unwrap();
        let e = refusal(step(&cur, &[&w.new, &w.old], Some(&west), true));
        assert!(e.contains("trust domain west.clusterset.local"), "{e}");
        // An issuer in the bundle, a duplicate, a key that is not the issuer's.
        let e = refusal(step(&cur, &[&w.old, &w.old_issuer], None, false));
        assert!(e.contains("not a self-signed CA"), "{e}");
        let e = refusal(step(&cur, &[&w.old, &w.old], None, false));
        assert!(e.contains("twice"), "{e}");
        let mismatched = PemPair {
            cert_pem: w.new_issuer.cert_pem.clone(),
            key_pem: w.old_issuer.key_pem.clone(),
        };
        let e = refusal(step(&cur, &[&w.new, &w.old], Some(&mismatched), false));
        assert!(e.contains("cannot sign"), "{e}");
    }
}
