//! Only exported Services' slices are cached from the remote (real API
//! servers): noise is dropped, a Service exported later is fetched, one
//! unexported is forgotten.

mod common;

use common::{WAIT, admin_kubeconfig, from_json, install_crd, link, mirror_slice, ready};

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use serde_json::json;
use strait_mirror::remote_slices::{Exported, ExportedSlices};
use strait_testenv::Cluster;
use strait_testenv::wait::{eventually, until_exists};
use strait_testenv::workloads::ensure_namespace;
use tokio::sync::{Notify, mpsc};

const EXPORTED: &str = "strait.dev/exported";

/// A Service without a selector (the Kubernetes slice controller leaves its
/// slices alone) and one slice of `endpoints` pods, all `ready` or not.
async fn service_with_slice(
    client: &Client,
    ns: &str,
    name: &str,
    exported: bool,
    endpoints: usize,
    ready: bool,
) {
    let labels = if exported {
        json!({ EXPORTED: "true" })
    } else {
        json!({})
    };
    Api::<Service>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": name, "labels": labels},
                              "spec": {"ports": [{"name": "http", "port": 80}]}})),
        )
        .await
        .unwrap();
    Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &slice(name, endpoints, ready))
        .await
        .unwrap();
}

fn slice(service: &str, endpoints: usize, ready: bool) -> EndpointSlice {
    let endpoints: Vec<_> = (0..endpoints)
        .map(|i| json!({"addresses": [format!("10.244.{}.{}", i / 250, i % 250 + 1)], "conditions": {"ready": ready}}))
        .collect();
    from_json(json!({
        "metadata": {"name": format!("{service}-abc"),
                     "labels": {"kubernetes.io/service-name": service,
                                "endpointslice.kubernetes.io/managed-by": "test.strait.dev"}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }))
}

async fn set_exported(client: &Client, ns: &str, name: &str, exported: bool) {
    let value = if exported { json!("true") } else { json!(null) };
    Api::<Service>::namespaced(client.clone(), ns)
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": { EXPORTED: value }}})),
        )
        .await
        .unwrap();
}

fn ready_count(slices: &ExportedSlices, ns: &str, name: &str) -> usize {
    slices
        .of_service(ns, name)
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_exported_services_slices_are_cached() {
    let west = Cluster::start("west").await.unwrap();
    let wc = west.client();
    ensure_namespace(&wc, "shop").await.unwrap();
    service_with_slice(&wc, "shop", "web", true, 3, true).await;
    for i in 0..40 {
        service_with_slice(&wc, "shop", &format!("noise-{i}"), false, 20, true).await;
    }

    // What a Link's worker runs: a store of the selected Services and the
    // slices of those.
    let (services, writer) = reflector::store::<Service>();
    let exported_changed = Arc::new(Notify::new());
    let changed = Arc::new(Notify::new());
    let (health, mut health_rx) = mpsc::channel(16);
    tokio::spawn(async move { while health_rx.recv().await.is_some() {} });
    let services_task = {
        let exported_changed = exported_changed.clone();
        let stream = reflector::reflector(
            writer,
            watcher(
                Api::<Service>::all(wc.clone()),
                watcher::Config::default().labels(&format!("{EXPORTED}=true")),
            )
            .default_backoff(),
        );
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while stream.next().await.is_some() {
                exported_changed.notify_one();
            }
        })
    };
    let (slices, _tasks) = ExportedSlices::follow(
        &wc,
        Exported {
            services,
            exports: None,
        },
        exported_changed,
        changed,
        health,
    );
    tokio::time::timeout(WAIT, slices.wait_until_ready())
        .await
        .expect("the first list of slices");
    assert_eq!(
        slices.len(),
        1,
        "only web's slice, none of the 40 unexported Services'"
    );
    assert_eq!(ready_count(&slices, "shop", "web"), 3);
    assert!(slices.of_service("shop", "noise-7").is_empty());
    let kept = &slices.of_service("shop", "web")[0];
    assert!(
        kept.metadata.managed_fields.is_none(),
        "stored slices are trimmed"
    );

    // Exported later: its slice, dropped until now, is fetched.
    set_exported(&wc, "shop", "noise-7", true).await;
    eventually("noise-7's slice fetched", WAIT, || async {
        match ready_count(&slices, "shop", "noise-7") {
            20 => Ok(()),
            n => Err(format!("{n} ready endpoints held")),
        }
    })
    .await;
    // From then on its changes are followed.
    let api: Api<EndpointSlice> = Api::namespaced(wc.clone(), "shop");
    api.replace("noise-7-abc", &PostParams::default(), &{
        let mut s = slice("noise-7", 5, true);
        s.metadata.resource_version = api
            .get("noise-7-abc")
            .await
            .unwrap()
            .metadata
            .resource_version;
        s
    })
    .await
    .unwrap();
    eventually("noise-7's change followed", WAIT, || async {
        match ready_count(&slices, "shop", "noise-7") {
            5 => Ok(()),
            n => Err(format!("{n} ready endpoints held")),
        }
    })
    .await;
    // A slice deleted while exported goes.
    api.delete("noise-7-abc", &DeleteParams::default())
        .await
        .unwrap();
    eventually("noise-7's deleted slice gone", WAIT, || async {
        match slices.of_service("shop", "noise-7").len() {
            0 => Ok(()),
            n => Err(format!("{n} slices held")),
        }
    })
    .await;
    api.create(&PostParams::default(), &slice("noise-7", 2, true))
        .await
        .unwrap();
    eventually("noise-7's new slice", WAIT, || async {
        match ready_count(&slices, "shop", "noise-7") {
            2 => Ok(()),
            n => Err(format!("{n} ready endpoints held")),
        }
    })
    .await;
    // Unexported: dropped, and its later changes are not kept.
    set_exported(&wc, "shop", "noise-7", false).await;
    eventually("noise-7's slice dropped", WAIT, || async {
        match slices.len() {
            1 => Ok(()),
            n => Err(format!("{n} slices held")),
        }
    })
    .await;
    api.delete("noise-3-abc", &DeleteParams::default())
        .await
        .unwrap();
    api.create(&PostParams::default(), &slice("noise-3", 4, true))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert_eq!(slices.len(), 1, "unexported Services' slices stay out");
    services_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_exported_later_gets_its_endpoints_mirrored_and_unexporting_removes_it() {
    let (east, west) = tokio::join!(Cluster::start("east"), Cluster::start("west"));
    let (east, west) = (east.unwrap(), west.unwrap());
    let (ec, wc) = (east.client(), west.client());
    install_crd(&ec).await;
    ensure_namespace(&ec, "shop").await.unwrap();
    ensure_namespace(&wc, "shop").await.unwrap();
    service_with_slice(&wc, "shop", "web", true, 1, true).await;
    service_with_slice(&wc, "shop", "late", false, 3, true).await;
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), Default::default()));
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;

    // The worker has listed (web is mirrored ready) while late was not
    // exported: late's slice was dropped then.
    eventually("web-west ready", WAIT, || async {
        let s = mirror_slice(&ec, "shop", "web-west").await?;
        if ready(&s) == vec![true, true] {
            Ok(())
        } else {
            Err(format!("ready = {:?}", ready(&s)))
        }
    })
    .await;
    set_exported(&wc, "shop", "late", true).await;
    // Ready only if the worker fetched late's slice (no slice: not ready).
    eventually("late-west ready", WAIT, || async {
        let s = mirror_slice(&ec, "shop", "late-west").await?;
        if ready(&s) == vec![true, true] {
            Ok(())
        } else {
            Err(format!("ready = {:?}", ready(&s)))
        }
    })
    .await;
    let api: Api<EndpointSlice> = Api::namespaced(wc.clone(), "shop");
    let mut not_ready = slice("late", 3, false);
    not_ready.metadata.resource_version =
        api.get("late-abc").await.unwrap().metadata.resource_version;
    api.replace("late-abc", &PostParams::default(), &not_ready)
        .await
        .unwrap();
    eventually("late-west not ready", WAIT, || async {
        let s = mirror_slice(&ec, "shop", "late-west").await?;
        if ready(&s) == vec![false, false] {
            Ok(())
        } else {
            Err(format!("ready = {:?}", ready(&s)))
        }
    })
    .await;
    set_exported(&wc, "shop", "late", false).await;
    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    eventually("late-west removed", WAIT, || async {
        match services.get_opt("late-west").await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    until_exists("web-west stays", WAIT, &services, "web-west").await;
    controller.abort();
}
