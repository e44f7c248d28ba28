//! The mirror controller against real API servers: east mirrors what west exports.

mod common;

use common::{
    WAIT, admin_kubeconfig, condition, export_web, from_json, install_crd, link, mirror_slice,
    pair_with_web, ready,
};

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Secret, Service};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use strait_mesh::link::Link;
use strait_testenv::Cluster;
use strait_testenv::wait::{eventually, until_exists};
use strait_testenv::workloads::{ensure_namespace, set_pod_ready};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exported_services_are_mirrored_follow_edits_and_leave_with_unexport_and_unlink() {
    let (east, west) = pair_with_web().await;
    let (ec, wc) = (east.client(), west.client());
    let metrics = strait_mirror::metrics::MirrorMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let config = strait_mirror::MirrorConfig {
        metrics,
        ..Default::default()
    };
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), config));
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;

    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    let mirror = until_exists("mirror web-west in east", WAIT, &services, "web-west").await;
    let labels = mirror.labels();
    assert_eq!(
        labels
            .get("strait.dev/mirrored-service")
            .map(String::as_str),
        Some("true")
    );
    assert_eq!(
        labels.get("strait.dev/cluster-name").map(String::as_str),
        Some("west")
    );
    assert_eq!(labels.get("app").map(String::as_str), Some("web"));
    assert!(
        !labels.contains_key("internal.example.com/team"),
        "excluded label copied: {labels:?}"
    );
    assert!(
        !labels.contains_key("strait.dev/exported"),
        "a mirror must not look exported: {labels:?}"
    );
    assert_eq!(
        mirror
            .annotations()
            .get("strait.dev/remote-svc-fq-name")
            .map(String::as_str),
        Some("web.shop.svc.cluster.local")
    );
    assert_eq!(
        mirror.annotations().get("docs").map(String::as_str),
        Some("yes")
    );
    let spec = mirror.spec.clone().unwrap();
    assert!(spec.selector.is_none());
    assert_eq!(spec.ports.unwrap()[0].port, 80);

    let slice = eventually("mirror EndpointSlice ready", WAIT, || async {
        let s = mirror_slice(&ec, "shop", "web-west").await?;
        if ready(&s) == vec![true, true] {
            Ok(s)
        } else {
            Err(format!("ready = {:?}", ready(&s)))
        }
    })
    .await;
    let addrs: Vec<String> = slice
        .endpoints
        .iter()
        .flatten()
        .flat_map(|e| e.addresses.clone())
        .collect();
    assert_eq!(
        addrs,
        vec!["10.77.0.1".to_string(), "10.77.0.2".to_string()]
    );
    assert_eq!(slice.ports.as_ref().unwrap()[0].port, Some(4143));
    assert_eq!(
        slice
            .labels()
            .get("kubernetes.io/service-name")
            .map(String::as_str),
        Some("web-west")
    );
    assert_eq!(
        slice
            .annotations()
            .get("strait.dev/gateway-identity")
            .map(String::as_str),
        Some("spiffe://west.strait/ns/strait-system/sa/strait-gateway")
    );

    // No ready endpoint in west → mirror endpoints not ready.
    set_pod_ready(
        &wc,
        "shop",
        "web-0",
        "10.244.9.1".parse().unwrap(),
        None,
        false,
    )
    .await
    .unwrap();
    eventually("mirror endpoints to turn not ready", WAIT, || async {
        let s = mirror_slice(&ec, "shop", "web-west").await?;
        if ready(&s) == vec![false, false] {
            Ok(())
        } else {
            Err(format!("ready = {:?}", ready(&s)))
        }
    })
    .await;

    // Port edit follows.
    let west_services: Api<Service> = Api::namespaced(wc.clone(), "shop");
    west_services
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"ports": [{"name": "http", "port": 8081, "targetPort": 8080}]}}),
            ),
        )
        .await
        .unwrap();
    eventually("mirror port 8081", WAIT, || async {
        let s = services.get("web-west").await.map_err(|e| e.to_string())?;
        let port = s.spec.and_then(|s| s.ports).map(|p| p[0].port);
        if port == Some(8081) {
            Ok(())
        } else {
            Err(format!("port {port:?}"))
        }
    })
    .await;

    // Link status reports it.
    let links: Api<Link> = Api::namespaced(ec.clone(), "strait-multicluster");
    eventually("Link status", WAIT, || async {
        let l = links.get("west").await.map_err(|e| e.to_string())?;
        let st = l.status.ok_or("no status")?;
        let cred = st
            .conditions
            .iter()
            .any(|c| c.type_ == "CredentialsValid" && c.status == "True");
        let remote = st
            .conditions
            .iter()
            .any(|c| c.type_ == "RemoteReachable" && c.status == "True");
        if cred && remote && st.mirrored_services == 1 {
            Ok(())
        } else {
            Err(format!("{st:?}"))
        }
    })
    .await;

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("mirror_services{link=\"strait-multicluster/west\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("mirror_remote_reachable{link=\"strait-multicluster/west\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("mirror_sync_duration_seconds_count{link=\"strait-multicluster/west\"}"),
        "{text}"
    );

    // Unexport → mirror gone.
    west_services
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"strait.dev/exported": null}}})),
        )
        .await
        .unwrap();
    eventually("mirror removed after unexport", WAIT, || async {
        match services
            .get_opt("web-west")
            .await
            .map_err(|e| e.to_string())?
        {
            None if mirror_slice(&ec, "shop", "web-west").await.is_err() => Ok(()),
            _ => Err("still there".into()),
        }
    })
    .await;

    // Re-export, then delete the Link → mirrors gone, Link gone (finalizer done).
    west_services
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"strait.dev/exported": "true"}}})),
        )
        .await
        .unwrap();
    until_exists("mirror back after re-export", WAIT, &services, "web-west").await;
    links
        .delete("west", &DeleteParams::default())
        .await
        .unwrap();
    eventually("Link and its mirrors gone", WAIT, || async {
        let link_gone = links
            .get_opt("west")
            .await
            .map_err(|e| e.to_string())?
            .is_none();
        let mirror_gone = services
            .get_opt("web-west")
            .await
            .map_err(|e| e.to_string())?
            .is_none();
        if link_gone && mirror_gone {
            Ok(())
        } else {
            Err(format!("link gone {link_gone}, mirror gone {mirror_gone}"))
        }
    })
    .await;
    controller.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_link_does_not_stop_another_and_conflicts_are_reported_not_overwritten() {
    let (east, west) = pair_with_web().await;
    let (ec, wc) = (east.client(), west.client());
    // A local, non-mirror Service already named like a mirror of the second link.
    let local_services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    local_services
        .create(&PostParams::default(), &from_json(json!({"metadata": {"name": "web-west2", "labels": {"owner": "me"}}, "spec": {"ports": [{"port": 1}]}})))
        .await
        .unwrap();
    // And an export into a namespace east does not have.
    ensure_namespace(&wc, "only-west").await.unwrap();
    Api::<Service>::namespaced(wc.clone(), "only-west")
        .create(&PostParams::default(), &from_json(json!({"metadata": {"name": "api", "labels": {"strait.dev/exported": "true"}}, "spec": {"ports": [{"port": 9}]}})))
        .await
        .unwrap();

    let controller = tokio::spawn(strait_mirror::run(ec.clone(), Default::default()));
    link(&ec, "broken", None).await; // its Secret does not exist
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;
    link(&ec, "west2", Some(&admin_kubeconfig(&west))).await;

    eventually(
        "the healthy link mirrors despite the broken one",
        WAIT,
        || async {
            local_services
                .get("web-west")
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    )
    .await;
    let links: Api<Link> = Api::namespaced(ec.clone(), "strait-multicluster");
    let condition = eventually("broken link reports its credentials", WAIT, || async {
        let l = links.get("broken").await.map_err(|e| e.to_string())?;
        l.status
            .and_then(|s| {
                s.conditions
                    .into_iter()
                    .find(|c| c.type_ == "CredentialsValid" && c.status == "False")
            })
            .ok_or_else(|| "no CredentialsValid=False yet".to_string())
    })
    .await;
    assert!(
        condition.message.contains("cluster-credentials-broken")
            && condition.message.contains("strait link"),
        "{}",
        condition.message
    );

    // The conflict: never overwritten, reported on the Link.
    let status = eventually(
        "west2 reports the conflict and the missing namespace",
        WAIT,
        || async {
            let st = links
                .get("west2")
                .await
                .map_err(|e| e.to_string())?
                .status
                .ok_or("no status")?;
            let reasons: Vec<&str> = st.services.iter().map(|s| s.reason.as_str()).collect();
            if reasons.contains(&"NameConflict") && reasons.contains(&"NamespaceMissing") {
                Ok(st)
            } else {
                Err(format!("{st:?}"))
            }
        },
    )
    .await;
    assert_eq!(status.mirrored_services, 0);
    let untouched = local_services.get("web-west2").await.unwrap();
    assert_eq!(
        untouched.labels().get("owner").map(String::as_str),
        Some("me")
    );
    assert!(
        !untouched
            .labels()
            .contains_key("strait.dev/mirrored-service")
    );

    // Fixing the broken Link's Secret makes it work without a restart.
    Api::<Secret>::namespaced(ec.clone(), "strait-multicluster")
        .create(&PostParams::default(), &from_json(json!({"metadata": {"name": "cluster-credentials-broken"}, "stringData": {"kubeconfig": admin_kubeconfig(&west)}})))
        .await
        .unwrap();
    until_exists(
        "the repaired link mirrors",
        WAIT,
        &local_services,
        "web-broken",
    )
    .await;

    // The missing namespace appears: the mirror follows (failed writes are retried).
    ensure_namespace(&ec, "only-west").await.unwrap();
    let in_new_ns: Api<Service> = Api::namespaced(ec.clone(), "only-west");
    until_exists(
        "mirror in the namespace created later",
        WAIT,
        &in_new_ns,
        "api-west",
    )
    .await;
    controller.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_steady_state_the_controller_writes_nothing() {
    let (east, west) = pair_with_web().await;
    let ec = east.client();
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), Default::default()));
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;
    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    eventually("mirror ready", WAIT, || async {
        let s = mirror_slice(&ec, "shop", "web-west").await?;
        if ready(&s).iter().all(|r| *r) {
            Ok(())
        } else {
            Err("not ready".into())
        }
    })
    .await;
    // Let the first status writes settle, then record versions across two periodic passes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let links: Api<Link> = Api::namespaced(ec.clone(), "strait-multicluster");
    let versions = || async {
        let mut v = BTreeMap::new();
        v.insert(
            "service",
            services.get("web-west").await.unwrap().resource_version(),
        );
        v.insert(
            "slice",
            mirror_slice(&ec, "shop", "web-west")
                .await
                .unwrap()
                .resource_version(),
        );
        v.insert("link", links.get("west").await.unwrap().resource_version());
        v
    };
    let before = versions().await;
    tokio::time::sleep(Duration::from_secs(22)).await;
    assert_eq!(
        before,
        versions().await,
        "objects were rewritten at steady state"
    );
    controller.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_outage_keeps_mirrors_sets_a_condition_and_resyncs_on_return() {
    // Controller logs land in the test's captured output, shown if it fails.
    strait_mesh::telemetry::init_test_tracing("strait_mirror=debug,warn");
    let (east, mut west) = pair_with_web().await;
    let (ec, wc) = (east.client(), west.client());
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), Default::default()));
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;
    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    until_exists("mirror", WAIT, &services, "web-west").await;
    let links: Api<Link> = Api::namespaced(ec.clone(), "strait-multicluster");
    links
        .patch(
            "west",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"stalenessTTL": "4s"}})),
        )
        .await
        .unwrap();
    eventually("mirror endpoints ready", WAIT, || async {
        let s = mirror_slice(&ec, "shop", "web-west").await?;
        if ready(&s).iter().all(|r| *r) && !ready(&s).is_empty() {
            Ok(())
        } else {
            Err(format!("{:?}", ready(&s)))
        }
    })
    .await;
    // Let the restarted worker (the spec changed) settle into its steady state.
    tokio::time::sleep(Duration::from_secs(2)).await;

    west.stop_apiserver();
    let (_, message) = eventually("RemoteReachable=False", Duration::from_secs(60), || async {
        match condition(&links, "west", "RemoteReachable").await {
            Some((s, m)) if s == "False" => Ok(((), m)),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(message.contains("mirrors are kept"), "{message}");
    // Nothing was deleted while the remote was away.
    services
        .get("web-west")
        .await
        .expect("mirror kept during the outage");
    mirror_slice(&ec, "shop", "web-west")
        .await
        .expect("endpoints kept during the outage");
    // Past the staleness TTL the endpoints are kept but marked not ready.
    eventually("stale endpoints not ready", WAIT, || async {
        let s = mirror_slice(&ec, "shop", "web-west").await?;
        if ready(&s) == vec![false, false] {
            Ok(())
        } else {
            Err(format!("{:?}", ready(&s)))
        }
    })
    .await;

    west.start_apiserver().await.unwrap();
    // A service exported while we were disconnected-then-reconnected shows up: the watch resynced.
    Api::<Service>::namespaced(wc.clone(), "shop")
        .create(&PostParams::default(), &from_json(json!({"metadata": {"name": "after", "labels": {"strait.dev/exported": "true"}}, "spec": {"ports": [{"port": 82}]}})))
        .await
        .unwrap();
    eventually(
        "resync after the remote returns",
        Duration::from_secs(60),
        || async {
            services
                .get("after-west")
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        },
    )
    .await;
    eventually("RemoteReachable=True again", WAIT, || async {
        match condition(&links, "west", "RemoteReachable").await {
            Some((s, _)) if s == "True" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    services
        .get("web-west")
        .await
        .expect("the original mirror is still there");
    eventually(
        "endpoints ready again after the remote returns",
        WAIT,
        || async {
            let s = mirror_slice(&ec, "shop", "web-west").await?;
            if ready(&s) == vec![true, true] {
                Ok(())
            } else {
                Err(format!("{:?}", ready(&s)))
            }
        },
    )
    .await;
    controller.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_controller_serves_links_to_two_clusters() {
    let (east, west, north) = tokio::join!(
        Cluster::start("east"),
        Cluster::start("west"),
        Cluster::start("north")
    );
    let (east, west, north) = (east.unwrap(), west.unwrap(), north.unwrap());
    let ec = east.client();
    install_crd(&ec).await;
    ensure_namespace(&ec, "shop").await.unwrap();
    export_web(&west.client(), "shop").await;
    export_web(&north.client(), "shop").await;
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), Default::default()));
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;
    link(&ec, "north", Some(&admin_kubeconfig(&north))).await;
    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    for name in ["web-west", "web-north"] {
        until_exists(name, WAIT, &services, name).await;
    }
    let north_mirror = services.get("web-north").await.unwrap();
    assert_eq!(
        north_mirror
            .labels()
            .get("strait.dev/cluster-name")
            .map(String::as_str),
        Some("north")
    );
    // Deleting one Link leaves the other's mirrors alone.
    Api::<Link>::namespaced(ec.clone(), "strait-multicluster")
        .delete("west", &DeleteParams::default())
        .await
        .unwrap();
    eventually("west mirrors gone", WAIT, || async {
        match services
            .get_opt("web-west")
            .await
            .map_err(|e| e.to_string())?
        {
            None => Ok(()),
            Some(_) => Err("still there".into()),
        }
    })
    .await;
    services
        .get("web-north")
        .await
        .expect("north's mirror stays");
    controller.abort();
}

/// West's admin kubeconfig with its user's credentials replaced by `user`.
fn kubeconfig_with_user(west: &Cluster, user: serde_json::Value) -> String {
    let mut kc: serde_yaml::Value = serde_yaml::from_str(&admin_kubeconfig(west)).unwrap();
    kc["users"][0]["user"] = serde_yaml::to_value(user).unwrap();
    serde_yaml::to_string(&kc).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_whose_kubeconfig_would_run_or_read_something_are_refused_and_others_keep_mirroring()
{
    let (east, west) = pair_with_web().await;
    let (ec, wc) = (east.client(), west.client());
    let dir = tempfile::tempdir().unwrap();
    // Were the exec plugin ever run, it would leave this file (and hand kube
    // a token, so a client built from it would really use it).
    let marker = dir.path().join("exec-plugin-ran");
    let exec = kubeconfig_with_user(
        &west,
        json!({"exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": "/bin/sh",
            "args": ["-c", format!("touch {}; echo '{{\"apiVersion\":\"client.authentication.k8s.io/v1\",\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"t\"}}}}'", marker.display())],
            "interactiveMode": "Never",
        }}),
    );
    let token_path = dir.path().join("token");
    std::fs::write(&token_path, "not-a-token").unwrap();
    let token_file = kubeconfig_with_user(&west, json!({"tokenFile": token_path}));

    let controller = tokio::spawn(strait_mirror::run(ec.clone(), Default::default()));
    link(&ec, "exec", Some(&exec)).await;
    link(&ec, "tokenfile", Some(&token_file)).await;
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;

    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    until_exists(
        "the good link mirrors beside the refused ones",
        WAIT,
        &services,
        "web-west",
    )
    .await;
    let links: Api<Link> = Api::namespaced(ec.clone(), "strait-multicluster");
    for (name, field, instead) in [
        ("exec", "`exec`", "`token`"),
        ("tokenfile", "`tokenFile`", "`token`"),
    ] {
        let c = eventually(&format!("{name}: CredentialsValid=False"), WAIT, || async {
            let l = links.get(name).await.map_err(|e| e.to_string())?;
            l.status
                .and_then(|s| {
                    s.conditions
                        .into_iter()
                        .find(|c| c.type_ == "CredentialsValid")
                })
                .filter(|c| c.status == "False")
                .ok_or_else(|| "not refused yet".to_string())
        })
        .await;
        assert_eq!(c.reason, "UnsafeKubeconfig", "{}", c.message);
        let secret = format!("cluster-credentials-{name}");
        for part in [
            secret.as_str(),
            field,
            instead,
            "inline data",
            "strait link",
        ] {
            assert!(c.message.contains(part), "{part:?} missing: {}", c.message);
        }
    }
    // An Event on each refused Link says the same.
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(ec.clone(), "strait-multicluster");
    eventually(
        "an UnsafeKubeconfig Event per refused Link",
        WAIT,
        || async {
            let list = events
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?;
            let mut regarding: Vec<String> = list
                .items
                .iter()
                .filter(|e| e.reason.as_deref() == Some("UnsafeKubeconfig"))
                .filter_map(|e| e.regarding.as_ref()?.name.clone())
                .collect();
            regarding.sort();
            regarding.dedup();
            if regarding == ["exec", "tokenfile"] {
                Ok(())
            } else {
                Err(format!("{regarding:?}"))
            }
        },
    )
    .await;

    // The good Link keeps following west; the refused ones mirror nothing.
    Api::<Service>::namespaced(wc.clone(), "shop")
        .create(&PostParams::default(), &from_json(json!({"metadata": {"name": "api", "labels": {"strait.dev/exported": "true"}}, "spec": {"ports": [{"port": 9}]}})))
        .await
        .unwrap();
    until_exists("a service exported later", WAIT, &services, "api-west").await;
    for name in ["web-exec", "web-tokenfile"] {
        assert!(services.get_opt(name).await.unwrap().is_none(), "{name}");
    }
    // The worker has retried the refused Links several times by now (backoff from 0.5 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!marker.exists(), "the exec plugin was run");
    controller.abort();
}
