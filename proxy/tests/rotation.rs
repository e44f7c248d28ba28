//! Trust-anchor rotation on a running mesh, no restarts (testenv nodes,
//! root): east and west under anchor A, linked through west's gateway across
//! a WAN, carry steady traffic (HTTP to the mirror, CONNECT across and within
//! a cluster: new tunnels and handshakes all along) while the operator's four
//! steps run: (1) bundle `A,B` everywhere; (2) both issuers re-issued under B;
//! (3) bundle `B,A` (B active): every component re-fetches onto B; (4) bundle
//! `B`. Asserted: no request failed, every component trusts B alone, and
//! every certificate a component presents chains to B (handshakes with a
//! B-only verifier succeed; with an A-only one they fail).

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use strait_mesh::identity::tls::TrustBundle;
use strait_mesh::identity::{SpiffeId, ca};
use strait_testenv::Wan;
use strait_testenv::http_get;
use strait_testenv::net::root_or_skip;
use strait_testenv::wait::eventually;

mod common;

use common::*;

const DAY: Duration = Duration::from_secs(86_400);
/// Waits of the rotation steps: polls every 2 s, re-fetches with ≤ 1 s jitter.
const STEP: Duration = Duration::from_secs(60);

fn id(s: &str) -> SpiffeId {
    s.parse().unwrap()
}

/// The metric lines of `name` (name or name{labels}) with their values.
fn series(metrics: &str, name: &str) -> Vec<(String, f64)> {
    metrics
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| {
            let (labels, value) = l.rsplit_once(' ')?;
            Some((labels.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// Every component's admin address: node proxies of both clusters and the gateway.
fn components(east: &Mesh, west: &Mesh, gateway: IpAddr) -> Vec<SocketAddr> {
    let mut all: Vec<SocketAddr> = east
        .topology
        .nodes()
        .iter()
        .chain(west.topology.nodes())
        .map(|n| SocketAddr::new(IpAddr::V4(n.ip()), 4191))
        .collect();
    all.push(SocketAddr::new(gateway, 4191));
    all
}

/// Waits until every component trusts exactly `anchors` (fingerprint
/// prefixes, the first active) and, if `on_active`, every certificate it
/// holds chains to the active one.
async fn everyone(all: &[SocketAddr], anchors: &[String], on_active: bool, what: &str) {
    eventually(what, STEP, || async {
        for admin in all {
            let m = http_get(*admin, "/metrics")
                .await
                .map_err(|e| format!("{admin}: {e}"))?;
            let trusted = series(&m, "identity_trust_anchor_info");
            let want: Vec<String> = anchors
                .iter()
                .enumerate()
                .map(|(i, a)| format!("active=\"{}\",fingerprint=\"{a}\"", i == 0))
                .collect();
            let ok = trusted.len() == want.len()
                && want.iter().all(|w| {
                    trusted.iter().any(|(l, v)| {
                        *v == 1.0
                            && (l.contains(w) || {
                                // Label order is the struct's: fingerprint, active.
                                let (a, f) = w.split_once(',').unwrap();
                                l.contains(f) && l.contains(a)
                            })
                    })
                });
            if !ok {
                return Err(format!("{admin} trusts {trusted:?}, want {want:?}"));
            }
            if on_active {
                let certs = series(&m, "identity_cert_chains_to_active_anchor");
                if certs.is_empty() || certs.iter().any(|(_, v)| *v != 1.0) {
                    return Err(format!("{admin}: certificates {certs:?}"));
                }
            }
        }
        Ok(())
    })
    .await;
}

/// Traffic from east's client pod until `stop` exists: HTTP to the mirror,
/// CONNECT to the mirror's echo port, CONNECT to a local Service's echo
/// port. One line per attempt: `ok <kind>` or `FAIL <kind> <what>`.
fn traffic_script(proxy: IpAddr, stop: &Path) -> String {
    format!(
        r#"
connect() {{ exec 3<>/dev/tcp/{proxy}/4140 || return 1
  printf 'CONNECT %s HTTP/1.1\r\nHost: x\r\n\r\nping-%s\n' "$1" "$2" >&3
  timeout 5 sed '/ping-/q' <&3; exec 3<&-; }}
i=0
while [ ! -e {stop} ]; do
  i=$((i+1))
  out=$(curl -sS --max-time 5 -x http://{proxy}:4140 http://web-west.shop.svc.cluster.local/r/$i 2>&1)
  case "$out" in *'"pod"'*) echo "ok http-west";; *) echo "FAIL http-west $out";; esac
  out=$(connect web-west.shop:9000 $i 2>&1)
  case "$out" in *" 200"*ping-$i*) echo "ok connect-west";; *) echo "FAIL connect-west $out";; esac
  out=$(connect here.shop:9000 $i 2>&1)
  case "$out" in *" 200"*ping-$i*) echo "ok connect-local";; *) echo "FAIL connect-local $out";; esac
done
echo done
"#,
        stop = stop.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trust_anchor_rotates_under_traffic_with_no_failed_request_and_no_restart() {
    if !root_or_skip("trust-anchor rotation") {
        return;
    }
    let proxy = Path::new(env!("CARGO_BIN_EXE_strait-proxy"));
    let old = ca::new_trust_anchor("strait trust anchor A", 2 * DAY).unwrap();
    let (mut east, mut west) = tokio::join!(
        start_mesh_named("east", 2, proxy, &old),
        start_mesh_named("west", 2, proxy, &old)
    );
    let west_api = west.topology.cluster().client();
    backend(&mut west, 0, "web-1", "web", &[]).await;
    backend(&mut west, 1, "web-2", "web", &[]).await;
    service(&west_api, "web").await;
    export(&west_api, "web", true).await;
    let (gw_pod, gw) = start_gateway(&mut west, 1, &[]).await;
    west.proxies.push(gw);
    let gw_ip = IpAddr::V4(gw_pod.ip());
    let wan = Wan::connect(&[east.topology.network(), west.topology.network()]).unwrap();
    wan.expose_pod(&gw_pod, &[4143]).unwrap();
    let east_api = east.topology.cluster().client();
    add_client(&mut east, 0).await;
    backend(&mut east, 1, "here-1", "here", &[]).await;
    service(&east_api, "here").await;
    mirror_service(&east_api, "web", "west", gw_ip, &west.trust_domain).await;
    eventually("east reaches west", WAIT, || async {
        answered_by(&curl(&east, &["http://web-west.shop.svc.cluster.local/"]))
    })
    .await;

    // Steady traffic, a real process in the client pod.
    let work = tempfile::tempdir().unwrap();
    let stop = work.path().join("stop");
    let client_pod = pod(&east, "client");
    let script = traffic_script(IpAddr::V4(client_pod.node().ip()), &stop);
    let log = work.path().join("traffic.log");
    let traffic = client_pod
        .spawn(
            "traffic",
            Path::new("/bin/bash"),
            &["-c".into(), script],
            &[],
            &log,
        )
        .unwrap();

    let all = components(&east, &west, gw_ip);
    let print = |a: &ca::PemPair| {
        let der = strait_mesh::identity::certs::parse_certs("a", a.cert_pem.as_bytes()).unwrap();
        strait_mesh::identity::trust::fingerprint(&der[0])[..16].to_string()
    };
    let new = ca::new_trust_anchor("strait trust anchor B", 2 * DAY).unwrap();
    let (a, b) = (print(&old), print(&new));
    everyone(&all, std::slice::from_ref(&a), true, "every component on A").await;

    // 1. Trust both, A still active.
    for mesh in [&east, &west] {
        mesh.set_trust_anchors(&format!("{}{}", old.cert_pem, new.cert_pem));
    }
    everyone(
        &all,
        &[a.clone(), b.clone()],
        true,
        "step 1: everyone trusts A and B",
    )
    .await;

    // 2. Re-issue both issuers under B (same trust domains).
    for mesh in [&mut east, &mut west] {
        let pair = ca::new_issuer(&new, &mesh.name, Some(&mesh.trust_domain), DAY).unwrap();
        mesh.reissue(&new, pair.clone());
        let client = mesh.topology.cluster().client();
        let token = strait_testenv::issuer::workload_token(&client, "shop", "client").await;
        eventually("step 2: the issuer signs under B", STEP, || async {
            let (r, _) = mesh
                .issuer
                .client()
                .issue(&token, None)
                .await
                .map_err(|e| e.to_string())?;
            (r.chain.trim() == pair.cert_pem.trim())
                .then_some(())
                .ok_or("still the old issuer".to_string())
        })
        .await;
    }

    // 3. B active: everyone re-fetches onto B.
    for mesh in [&east, &west] {
        mesh.set_trust_anchors(&format!("{}{}", new.cert_pem, old.cert_pem));
    }
    everyone(
        &all,
        &[b.clone(), a.clone()],
        true,
        "step 3: every certificate under B",
    )
    .await;

    // 4. Drop A.
    for mesh in [&east, &west] {
        mesh.set_trust_anchors(&new.cert_pem);
    }
    everyone(
        &all,
        std::slice::from_ref(&b),
        true,
        "step 4: everyone trusts B alone",
    )
    .await;
    // New tunnels after the last step too.
    tokio::time::sleep(Duration::from_secs(3)).await;
    std::fs::write(&stop, "").unwrap();
    eventually("the traffic loop ends", WAIT, || async {
        let t = std::fs::read_to_string(&log).unwrap_or_default();
        t.contains("done").then_some(()).ok_or(t)
    })
    .await;
    drop(traffic);
    let t = std::fs::read_to_string(&log).unwrap();
    let failed: Vec<&str> = t.lines().filter(|l| l.starts_with("FAIL")).collect();
    let ok = t.lines().filter(|l| l.starts_with("ok ")).count();
    eprintln!(
        "rotation under traffic: {ok} requests and tunnels ok, {} failed",
        failed.len()
    );
    assert!(failed.is_empty(), "{} failed: {failed:#?}", failed.len());
    for kind in ["http-west", "connect-west", "connect-local"] {
        assert!(
            t.lines().filter(|l| *l == format!("ok {kind}")).count() >= 5,
            "too little {kind} traffic to prove anything:\n{t}"
        );
    }

    // No certificate chains to A: servers presented to a B-only verifier pass,
    // to an A-only verifier fail.
    let only_b = TrustBundle::from_pem(new.cert_pem.as_bytes()).unwrap();
    let only_a = TrustBundle::from_pem(old.cert_pem.as_bytes()).unwrap();
    let (me, _) = component_identity(&west, "strait-proxy");
    let gateway_id = id(&format!(
        "spiffe://{}/ns/strait-system/sa/strait-gateway",
        west.trust_domain
    ));
    let gw_addr = SocketAddr::new(gw_ip, 4143);
    let probe_b =
        strait_mesh::tunnel::quic::GatewayClient::new(only_b.clone(), me.clone()).unwrap();
    probe_b
        .probe(gw_addr, &gateway_id)
        .await
        .expect("the gateway's certificate chains to B");
    let probe_a =
        strait_mesh::tunnel::quic::GatewayClient::new(only_a.clone(), me.clone()).unwrap();
    assert!(
        probe_a.probe(gw_addr, &gateway_id).await.is_err(),
        "the gateway still under A"
    );
    let servers = [
        (&west, 0, "web", "web.shop.identity.strait.internal"),
        (&west, 1, "web", "web.shop.identity.strait.internal"),
        (&east, 1, "web", "web.shop.identity.strait.internal"),
    ];
    for (mesh, node, sa, sni) in servers {
        let (caller, _) = issued_identity(mesh, "shop", "client").await;
        let addr = SocketAddr::new(IpAddr::V4(mesh.topology.node(node).unwrap().ip()), 4143);
        let server = id(&format!("spiffe://{}/ns/shop/sa/{sa}", mesh.trust_domain));
        assert!(
            tls_accepted(addr, &only_b, caller.clone(), &server, sni).await,
            "{} node {node}: its certificate chains to B",
            mesh.name
        );
        assert!(
            !tls_accepted(addr, &only_a, caller, &server, sni).await,
            "{} node {node}: a certificate still under A",
            mesh.name
        );
    }
}
