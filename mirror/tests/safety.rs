//! Mirror write safety against real API servers: Strait writes and deletes
//! only its own mirrors, restores one deleted or edited by hand, and two
//! Links claiming one cluster name do not fight.

mod common;

use common::{WAIT, admin_kubeconfig, from_json, link, link_with, mirror_slice, pair_with_web};

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use strait_mesh::link::Link;
use strait_testenv::wait::{eventually, until_exists};

const NS: &str = "strait-multicluster";

async fn versions(ec: &Client) -> (Option<String>, Option<String>) {
    let svc = Api::<Service>::namespaced(ec.clone(), "shop")
        .get("web-west")
        .await
        .unwrap();
    let slice = mirror_slice(ec, "shop", "web-west").await.unwrap();
    (svc.resource_version(), slice.resource_version())
}

fn addresses(slice: &EndpointSlice) -> Vec<String> {
    slice
        .endpoints
        .iter()
        .flatten()
        .flat_map(|e| e.addresses.clone())
        .collect()
}

/// A mirror deleted or edited by hand comes back within a pass (measured),
/// and a mirror nobody touches is never written again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_deleted_or_edited_mirror_is_restored_and_an_untouched_one_is_not_written() {
    let (east, west) = pair_with_web().await;
    let ec = east.client();
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), Default::default()));
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;
    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    let slices: Api<EndpointSlice> = Api::namespaced(ec.clone(), "shop");
    let first = until_exists("mirror web-west", WAIT, &services, "web-west").await;
    until_exists("mirror slice web-west", WAIT, &slices, "web-west").await;
    let settled = versions(&ec).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(settled, versions(&ec).await, "untouched mirror rewritten");

    // Deleted by hand: back, as a new object.
    let deleted = Instant::now();
    services
        .delete("web-west", &DeleteParams::default())
        .await
        .unwrap();
    let back = eventually("the deleted mirror to come back", WAIT, || async {
        match services.get_opt("web-west").await {
            Ok(Some(s)) if s.uid() != first.uid() => Ok(s),
            other => Err(format!("{:?}", other.map(|s| s.map(|s| s.uid())))),
        }
    })
    .await;
    let restore_delete = deleted.elapsed();
    assert_eq!(
        back.spec.unwrap().ports.unwrap()[0].port,
        80,
        "restored as it was"
    );

    // Edited by hand (a field Strait sets): put back.
    let edited = Instant::now();
    slices
        .patch(
            "web-west",
            &PatchParams::default(),
            &Patch::Merge(json!({"endpoints": [{"addresses": ["10.99.99.99"]}]})),
        )
        .await
        .unwrap();
    eventually("the edited slice to be put back", WAIT, || async {
        let s = mirror_slice(&ec, "shop", "web-west").await?;
        let a = addresses(&s);
        (a == ["10.77.0.1", "10.77.0.2"])
            .then_some(())
            .ok_or(format!("{a:?}"))
    })
    .await;
    let restore_edit = edited.elapsed();
    eprintln!(
        "MEASURED restore: hand-deleted mirror Service back in {restore_delete:?}, hand-edited EndpointSlice put back in {restore_edit:?}"
    );
    assert!(restore_delete < Duration::from_secs(5) && restore_edit < Duration::from_secs(5));

    // And then it settles: no write storm after restoring.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let settled = versions(&ec).await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(
        settled,
        versions(&ec).await,
        "restored mirror rewritten again (across a periodic pass)"
    );
    controller.abort();
}

/// A user's Service named like a mirror, or dressed as one without Strait
/// having written it, is never overwritten nor deleted; the status and an
/// Event name it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_service_is_never_written_or_deleted_and_the_conflict_is_named() {
    let (east, west) = pair_with_web().await;
    let (ec, wc) = (east.client(), west.client());
    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    // Carries Strait's labels, but Strait never wrote it.
    let lookalike = services
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": "api-west", "labels": {"strait.dev/mirrored-service": "true", "strait.dev/cluster-name": "west"}},
                              "spec": {"ports": [{"port": 1}]}})),
        )
        .await
        .unwrap();
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), Default::default()));
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;
    let mirror = until_exists("mirror web-west", WAIT, &services, "web-west").await;

    // A user replaces the mirror with their own Service of the same name
    // (again, should the controller restore the mirror in between).
    let users = eventually("the user's Service to replace the mirror", WAIT, || async {
        let _ = services.delete("web-west", &DeleteParams::default()).await;
        services
            .create(
                &PostParams::default(),
                &from_json(
                    json!({"metadata": {"name": "web-west", "labels": {"owner": "me"}},
                                  "spec": {"ports": [{"port": 7}]}}),
                ),
            )
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    assert_ne!(users.uid(), mirror.uid());
    let links: Api<Link> = Api::namespaced(ec.clone(), NS);
    let entry = eventually("the Link to report the conflict", WAIT, || async {
        let st = links
            .get("west")
            .await
            .map_err(|e| e.to_string())?
            .status
            .ok_or("no status")?;
        st.services
            .into_iter()
            .find(|s| s.name == "web" && s.reason == "NameConflict")
            .ok_or(format!("{:?}", st.conditions))
    })
    .await;
    assert!(
        entry.message.contains("Service shop/web-west")
            && entry
                .message
                .contains("no strait.dev/mirrored-service=true label"),
        "{}",
        entry.message
    );
    let events: Api<Event> = Api::namespaced(ec.clone(), NS);
    eventually("a NameConflict Event on the Link", WAIT, || async {
        let list = events
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("NameConflict")
                    && e.message.as_deref().unwrap_or("").contains("shop/web-west")
            })
            .then_some(())
            .ok_or("no Event yet".to_string())
    })
    .await;
    // Unexported: the user's Service stays, untouched.
    Api::<Service>::namespaced(wc.clone(), "shop")
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"strait.dev/exported": null}}})),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let now = services.get("web-west").await.unwrap();
    assert_eq!(
        (now.uid(), now.resource_version()),
        (users.uid(), users.resource_version()),
        "the user's Service was written"
    );

    // The Link goes: its mirrors go, the lookalike and the user's stay.
    links
        .delete("west", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the Link to be gone", WAIT, || async {
        match links.get_opt("west").await {
            Ok(None) => Ok(()),
            other => Err(format!("{:?}", other.map(|l| l.map(|l| l.name_any())))),
        }
    })
    .await;
    for (name, uid) in [("api-west", lookalike.uid()), ("web-west", users.uid())] {
        let s = services.get(name).await.unwrap();
        assert_eq!(s.uid(), uid, "{name} was deleted");
    }
    controller.abort();
}

/// Two Links naming the same cluster: the newer is refused (condition and
/// Event naming the older); the older keeps mirroring; once it is deleted the
/// newer takes over, keeping the mirrors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_newer_of_two_links_claiming_one_cluster_name_waits_for_the_older() {
    let (east, west) = pair_with_web().await;
    let ec = east.client();
    let controller = tokio::spawn(strait_mirror::run(ec.clone(), Default::default()));
    link(&ec, "west", Some(&admin_kubeconfig(&west))).await;
    let services: Api<Service> = Api::namespaced(ec.clone(), "shop");
    let mirror = until_exists("mirror web-west", WAIT, &services, "web-west").await;
    // Creation times have a resolution of one second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    link_with(
        &ec,
        "west-again",
        Some(&admin_kubeconfig(&west)),
        json!({"targetClusterName": "west"}),
    )
    .await;
    let links: Api<Link> = Api::namespaced(ec.clone(), NS);
    let accepted = |name: &'static str| {
        let links = links.clone();
        async move {
            links
                .get(name)
                .await
                .ok()?
                .status?
                .conditions
                .into_iter()
                .find(|c| c.type_ == "Accepted")
        }
    };
    let refused = eventually("west-again to be refused", WAIT, || async {
        match accepted("west-again").await {
            Some(c) if c.status == "False" => Ok(c),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(refused.reason, "DuplicateClusterName");
    assert!(
        refused.message.contains("strait-multicluster/west ")
            && refused.message.contains("\"west\""),
        "{}",
        refused.message
    );
    assert_eq!(
        accepted("west").await.map(|c| c.status).as_deref(),
        Some("True")
    );
    let events: Api<Event> = Api::namespaced(ec.clone(), NS);
    let refusal_events = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("DuplicateClusterName"))
        .count();
    assert!(refusal_events >= 1, "an Event for the refusal");
    // No fight: the mirror stays as the older Link wrote it.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let now = services.get("web-west").await.unwrap();
    assert_eq!(
        (now.uid(), now.resource_version()),
        (mirror.uid(), mirror.resource_version())
    );

    // The older goes: the newer takes over, and the mirror is kept.
    let deleted = Instant::now();
    links
        .delete("west", &DeleteParams::default())
        .await
        .unwrap();
    eventually("west-again to take over", WAIT, || async {
        match accepted("west-again").await {
            Some(c) if c.status == "True" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    eprintln!(
        "MEASURED duplicate cluster name: the newer Link accepted {:?} after the older was deleted",
        deleted.elapsed()
    );
    let kept = services.get("web-west").await.unwrap();
    assert_eq!(
        kept.uid(),
        mirror.uid(),
        "the mirror was deleted and made again"
    );
    controller.abort();
}
