//! Two controller processes against one cluster: one leads (holds the
//! Lease) and mirrors; SIGKILL it under steady export churn and the other
//! takes over within 10 s, losing and duplicating nothing and rewriting
//! nothing that did not change.

mod common;

use common::{WAIT, admin_kubeconfig, from_json, link, pair_with_web};

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use strait_testenv::wait::eventually;

const STABLE: usize = 10;
const CHURNED: usize = 5;

/// A controller process, killed when dropped (a failing test leaves none behind).
struct Replica(Child);

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn controller(kubeconfig: &str, name: &str, log: &std::path::Path) -> Replica {
    Replica(
        Command::new(env!("CARGO_BIN_EXE_strait-mirror"))
            .env("KUBECONFIG", kubeconfig)
            .env("POD_NAME", name)
            .args(["--no-gateway-probe", "--admin-addr", "127.0.0.1:0"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .expect("start strait-mirror"),
    )
}

/// The `mirror_leader` gauge of the replica logging to `log` (its admin
/// address is in its log: it listens on a free port).
async fn leader_metric(log: &std::path::Path) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let text = std::fs::read_to_string(log).map_err(|e| e.to_string())?;
    let addr = text
        .lines()
        .find(|l| l.contains("mirror controller starting"))
        .and_then(|l| l.split("127.0.0.1:").nth(1))
        .map(|rest| {
            rest.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .ok_or("no admin address logged yet")?;
    let mut conn = tokio::net::TcpStream::connect(format!("127.0.0.1:{addr}"))
        .await
        .map_err(|e| e.to_string())?;
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: mirror\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut body = String::new();
    conn.read_to_string(&mut body)
        .await
        .map_err(|e| e.to_string())?;
    body.lines()
        .find(|l| l.starts_with("mirror_leader "))
        .map(|l| l.trim_start_matches("mirror_leader ").to_string())
        .ok_or(format!("no mirror_leader in {body}"))
}

async fn holder(leases: &Api<Lease>) -> Option<String> {
    leases
        .get_opt("strait-mirror")
        .await
        .ok()??
        .spec?
        .holder_identity
}

async fn export(west: &Client, name: &str, exported: bool) {
    let label = exported.then_some("true");
    Api::<Service>::namespaced(west.clone(), "shop")
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"strait.dev/exported": label}}})),
        )
        .await
        .unwrap();
}

/// Every local mirror: name → (Service version, slice version, port).
async fn mirrors(east: &Client) -> BTreeMap<String, (String, String, i32)> {
    let lp = ListParams::default().labels("strait.dev/mirrored-service=true");
    let services = Api::<Service>::namespaced(east.clone(), "shop")
        .list(&lp)
        .await
        .unwrap();
    let slices: BTreeMap<String, String> = Api::<EndpointSlice>::namespaced(east.clone(), "shop")
        .list(&lp)
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|s| (s.name_any(), s.resource_version().unwrap_or_default()))
        .collect();
    services
        .items
        .into_iter()
        .map(|s| {
            let name = s.name_any();
            let port = s.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port;
            let slice = slices.get(&name).cloned().unwrap_or_default();
            (
                name,
                (s.resource_version().unwrap_or_default(), slice, port),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_under_churn_hands_over_within_ten_seconds_without_loss_or_rewrites() {
    let (east, west) = pair_with_web().await;
    let (ec, wc) = (east.client(), west.client());
    let west_services: Api<Service> = Api::namespaced(wc.clone(), "shop");
    for (prefix, n, port) in [("stable", STABLE, 100), ("churn", CHURNED, 200)] {
        for i in 0..n {
            west_services
                .create(
                    &PostParams::default(),
                    &from_json(json!({"metadata": {"name": format!("{prefix}-{i}"), "labels": {"strait.dev/exported": "true"}},
                                      "spec": {"ports": [{"port": port + i}]}})),
                )
                .await
                .unwrap();
        }
    }
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;
    let logs = tempfile::tempdir().unwrap();
    let kubeconfig = east.kubeconfig_path().display().to_string();
    let mut replicas: BTreeMap<String, Replica> = ["mirror-a", "mirror-b"]
        .into_iter()
        .map(|n| {
            let log = logs.path().join(format!("{n}.log"));
            (n.to_string(), controller(&kubeconfig, n, &log))
        })
        .collect();
    let leases: Api<Lease> = Api::namespaced(ec.clone(), "strait-multicluster");
    let leader = eventually("a leader", WAIT, || async {
        holder(&leases).await.ok_or("no holder yet".to_string())
    })
    .await;
    let all: BTreeSet<String> = std::iter::once("web-west".to_string())
        .chain((0..STABLE).map(|i| format!("stable-{i}-west")))
        .chain((0..CHURNED).map(|i| format!("churn-{i}-west")))
        .collect();
    eventually("every mirror written by the leader", WAIT, || async {
        let have: BTreeSet<String> = mirrors(&ec).await.into_keys().collect();
        (have == all).then_some(()).ok_or(format!("{have:?}"))
    })
    .await;
    let before = mirrors(&ec).await;

    // Churn: one churned service changes its export every ~100 ms.
    let churn = {
        let wc = wc.clone();
        tokio::spawn(async move {
            for step in 0usize.. {
                let i = step % CHURNED;
                export(&wc, &format!("churn-{i}"), (step / CHURNED) % 2 == 1).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut killed = replicas.remove(&leader).unwrap();
    killed.0.kill().unwrap(); // SIGKILL
    let at = Instant::now();
    killed.0.wait().unwrap();
    let next = eventually("the other replica to take the Lease", WAIT, || async {
        match holder(&leases).await {
            Some(h) if h != leader => Ok(h),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let takeover = at.elapsed();
    eprintln!(
        "MEASURED leader takeover after SIGKILL under churn: {takeover:?} ({leader} → {next})"
    );
    assert!(
        takeover < Duration::from_secs(10),
        "takeover took {takeover:?}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    churn.abort();
    let _ = churn.await;
    // Settle on a known state: even churned services exported, odd not.
    for i in 0..CHURNED {
        export(&wc, &format!("churn-{i}"), i % 2 == 0).await;
    }
    let expected: BTreeSet<String> = all
        .iter()
        .filter(|n| {
            n.strip_prefix("churn-")
                .and_then(|r| r.trim_end_matches("-west").parse::<usize>().ok())
                .is_none_or(|i| i % 2 == 0)
        })
        .cloned()
        .collect();
    let after = eventually("mirrors to match the exports exactly", WAIT, || async {
        let now = mirrors(&ec).await;
        let have: BTreeSet<String> = now.keys().cloned().collect();
        (have == expected && now.values().all(|(_, slice, _)| !slice.is_empty()))
            .then_some(now)
            .ok_or(format!("{have:?}"))
    })
    .await;
    for (name, (_, _, port)) in &after {
        let want = match name.split('-').collect::<Vec<_>>()[..] {
            ["stable", i, _] => 100 + i.parse::<i32>().unwrap(),
            ["churn", i, _] => 200 + i.parse::<i32>().unwrap(),
            _ => 80,
        };
        assert_eq!(*port, want, "{name} has the wrong port");
    }
    // The new leader did not rewrite what did not change.
    let rewritten: Vec<&String> = before
        .iter()
        .filter(|(n, _)| !n.starts_with("churn-"))
        .filter(|(n, v)| after.get(*n) != Some(v))
        .map(|(n, _)| n)
        .collect();
    eprintln!(
        "MEASURED after takeover: {} of {} unchanged mirrors rewritten",
        rewritten.len(),
        STABLE + 1
    );
    assert!(
        rewritten.is_empty(),
        "rewritten after takeover: {rewritten:?}"
    );
    assert_eq!(
        holder(&leases).await.as_deref(),
        Some(next.as_str()),
        "leadership stable"
    );
    let log_of = |n: &str| logs.path().join(format!("{n}.log"));
    assert_eq!(leader_metric(&log_of(&next)).await.unwrap(), "1");

    // A graceful stop (a rollout's SIGTERM) hands over at once: the leader
    // releases the Lease instead of letting it run out.
    let third = "mirror-c".to_string();
    replicas.insert(
        third.clone(),
        controller(&kubeconfig, &third, &log_of(&third)),
    );
    let standing_by = eventually("the new replica to stand by", WAIT, || async {
        leader_metric(&log_of(&third)).await
    })
    .await;
    assert_eq!(standing_by, "0", "a follower does not lead");
    let pid = replicas[&next].0.id().to_string();
    let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(status.success());
    let at = Instant::now();
    eventually("mirror-c to take the released Lease", WAIT, || async {
        match holder(&leases).await {
            Some(h) if h == third => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let handover = at.elapsed();
    eprintln!("MEASURED leader handover after SIGTERM: {handover:?}");
    assert!(
        handover < Duration::from_secs(4),
        "a released Lease waited {handover:?}"
    );
    assert_eq!(leader_metric(&log_of(&third)).await.unwrap(), "1");
    drop(replicas);
}
