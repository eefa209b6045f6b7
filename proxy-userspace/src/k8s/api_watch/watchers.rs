//! One task per watched kind: Services and EndpointSlices (the labels kproxy reads), this Node
//! (zone, deletion state, primary address) and the ServiceCIDRs, each through [`reflect`].

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use anyhow::Result;
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice, networking::v1::ServiceCIDR};
use kube::{Api, Client, ResourceExt as _, api::ListParams};
use serde::de::DeserializeOwned;

use super::{
    Changes, Kinded, ObjectKey, Snapshot, WatchObserver, WatchOptions, WatchProgress,
    changes::{KeptKind, key, origin},
    label_selector,
    reflect::{Selectors, Update, reflect},
};
use crate::k8s::manifest::Sourced;

/// The Node label naming its zone (zone hints follow it).
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// The taint the cluster autoscaler puts on a node it is about to remove.
const AUTOSCALER_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Watches Services and EndpointSlices in all namespaces (and this node) until
/// the process stops. Each kind is listed, then watched from the list's
/// resourceVersion, as client-go's reflector does for kube-proxy: a watch
/// that ends or breaks resumes from the last resourceVersion seen (events and
/// bookmarks advance it); a 410 Gone, whether the answer to the watch request
/// or an ERROR event in the stream, and an unreadable line in the stream (the
/// change it carried is lost) start over with a list, which replaces that
/// kind's snapshot. Failures are retried with kube-runtime's default backoff.
///
/// kube-runtime's `watcher` is not used: it retries a watch request answered
/// 410 with the same stale resourceVersion forever, skips an unreadable line
/// and carries on (losing that change), and shows neither bookmarks nor
/// accepted watches, so a quiet cluster and a dead connection look alike to
/// `/healthz`.
pub async fn watch_cluster(
    client: Client,
    node_name: Option<String>,
    service_proxy_name: Option<String>,
    changes: Arc<Changes>,
    options: WatchOptions,
) -> Result<()> {
    let selector = label_selector(service_proxy_name.as_deref());
    let now = SystemTime::now();
    let track = |name| changes.health.as_ref().map(|h| h.watch_source(name, options.progress_timeout, now));
    let (service_health, slice_health) = (track("Service watch"), track("EndpointSlice watch"));
    let services = watch_kind::<Service>(
        client.clone(),
        selector.clone(),
        Arc::clone(&changes),
        options,
        service_health,
    );
    let slices =
        watch_kind::<EndpointSlice>(client.clone(), selector, Arc::clone(&changes), options, slice_health);
    let node = watch_node(client.clone(), node_name, Arc::clone(&changes), options);
    let service_cidrs = watch_service_cidrs(client, Arc::clone(&changes), options);
    let blindness = report_blindness(changes.health.clone());
    tokio::join!(services, slices, node, service_cidrs, blindness);
    Ok(())
}

/// One kind into the snapshot, for ever.
async fn watch_kind<K>(
    client: Client,
    selector: String,
    changes: Arc<Changes>,
    options: WatchOptions,
    health: Option<Arc<dyn WatchProgress>>,
) where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
    Box<K>: Into<Kinded>,
{
    let is_service = K::kind(&()) == "Service";
    let selectors = Selectors { labels: Some(selector), fields: None };
    // Kept compactly page by page as a list comes, before the snapshot is locked.
    let listed = |object: K| (key(object.namespace(), object.name_any()), Box::new(object).into().kept());
    reflect(client, selectors, options, health, listed, |update: Update<K, (ObjectKey, KeptKind)>| {
        match update {
            Update::Listed(kept) => {
                let count = kept.len() as u64;
                {
                    let mut snapshot = changes.snapshot.lock().expect("poisoned");
                    if is_service {
                        snapshot.services.clear();
                    } else {
                        snapshot.slices.clear();
                    }
                    for (k, object) in kept {
                        object.store(&mut snapshot, k);
                    }
                }
                {
                    let mut ready = changes.ready.lock().expect("poisoned");
                    if is_service {
                        ready.0 = true;
                    } else {
                        ready.1 = true;
                    }
                }
                if is_service { changes.queue(count, 0, None) } else { changes.queue(0, count, None) }
            }
            Update::Applied(object) => {
                let k = key(object.namespace(), object.name_any());
                let kinded: Kinded = Box::new(object).into();
                let trigger = kinded.trigger_time();
                let kept = kinded.kept();
                kept.store(&mut changes.snapshot.lock().expect("poisoned"), k);
                if is_service { changes.queue(1, 0, None) } else { changes.queue(0, 1, trigger) }
            }
            Update::Deleted(object) => {
                let k = key(object.namespace(), object.name_any());
                {
                    let mut snapshot = changes.snapshot.lock().expect("poisoned");
                    if is_service {
                        snapshot.services.remove(&k);
                    } else {
                        snapshot.slices.remove(&k);
                    }
                }
                if is_service { changes.queue(1, 0, None) } else { changes.queue(0, 1, None) }
            }
        }
    })
    .await
}

/// This node, for `internalTrafficPolicy: Local`; kproxy only needs to know
/// it exists, so its events are logged.
async fn watch_node(client: Client, node_name: Option<String>, changes: Arc<Changes>, options: WatchOptions) {
    let Some(name) = node_name else {
        tracing::warn!("no --hostname-override or NODE_NAME: every endpoint counts as remote");
        return;
    };
    let selectors = Selectors { labels: None, fields: Some(format!("metadata.name={name}")) };
    let mut seen = false;
    reflect(client, selectors, options, None, Box::new, |update: Update<k8s_openapi::api::core::v1::Node>| {
        let node = match update {
            Update::Listed(nodes) => nodes.into_iter().next().map(|node| *node),
            Update::Applied(node) => Some(node),
            Update::Deleted(_) => None,
        };
        if let Some(node) = node.as_ref().filter(|_| !seen) {
            tracing::info!(node = %node.name_any(), "watching this node");
            seen = true;
        }
        let zone = node.as_ref().and_then(|n| n.labels().get(ZONE_LABEL)).filter(|z| !z.is_empty()).cloned();
        // A node that is gone, being deleted or drained by the cluster autoscaler should lose its load
        // balancer traffic before its pods go: kube-proxy's /healthz says 503 (KEP-3836).
        let eligible = node.as_ref().is_some_and(|n| {
            n.metadata.deletion_timestamp.is_none()
                && !n.spec.iter().flat_map(|s| s.taints.iter().flatten()).any(|t| t.key == AUTOSCALER_TAINT)
        });
        changes.node_seen(zone, eligible || node.is_none() && !seen);
        changes.node_address_seen(node.as_ref().and_then(node_primary_ipv4));
    })
    .await
}

/// The ServiceCIDRs (`networking.k8s.io/v1`), as kube-proxy's ServiceCIDR informer watches them: a
/// change re-syncs. Not part of `/healthz` nor of the first sync's readiness: until a list arrives no
/// range is known and nothing is dropped, as with kube-proxy. An API server that does not serve the
/// kind (before Kubernetes 1.33, or with it disabled) is told once, and not asked again.
async fn watch_service_cidrs(client: Client, changes: Arc<Changes>, options: WatchOptions) {
    let api: Api<ServiceCIDR> = Api::all(client.clone());
    if let Err(kube::Error::Api(status)) = api.list(&ListParams::default().limit(1)).await
        && status.code == 404
    {
        tracing::warn!(
            "the API server serves no ServiceCIDRs (networking.k8s.io/v1): unallocated service addresses \
             are dropped only inside --service-cidr"
        );
        return;
    }
    let selectors = Selectors { labels: None, fields: None };
    reflect(client, selectors, options, None, Box::new, |update: Update<ServiceCIDR>| {
        {
            let mut snapshot = changes.snapshot.lock().expect("poisoned");
            let store = |object: ServiceCIDR, snapshot: &mut Snapshot| {
                let k = key(None, object.name_any());
                let origin = origin("ServiceCIDR", object.resource_version());
                snapshot.service_cidrs.insert(k, Arc::new(Sourced { origin, object }));
            };
            match update {
                Update::Listed(objects) => {
                    snapshot.service_cidrs.clear();
                    for object in objects {
                        store(*object, &mut snapshot);
                    }
                }
                Update::Applied(object) => store(object, &mut snapshot),
                Update::Deleted(object) => {
                    snapshot.service_cidrs.remove(&key(None, object.name_any()));
                }
            }
        }
        // A sync, but no Service or endpoint change for the metrics: kube-proxy counts none either.
        changes.queue(0, 0, None);
    })
    .await
}

/// The node's primary IPv4 address as kube-proxy reads it (`GetNodeHostIPs`): the first IPv4
/// address among its InternalIPs, then its ExternalIPs.
pub fn node_primary_ipv4(node: &k8s_openapi::api::core::v1::Node) -> Option<std::net::Ipv4Addr> {
    let addresses = node.status.as_ref()?.addresses.as_ref()?;
    ["InternalIP", "ExternalIP"]
        .into_iter()
        .flat_map(|kind| addresses.iter().filter(move |a| a.type_ == kind))
        .find_map(|a| a.address.trim().parse().ok())
}

/// Logs when the API watches turn blind and when they see again (`/healthz`
/// tells the same at any time); checked every second.
async fn report_blindness(health: Option<Arc<dyn WatchObserver>>) {
    let Some(health) = health else { return };
    let mut blind = false;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        match (blind, health.blind(SystemTime::now())) {
            (false, Some(reason)) => {
                tracing::error!(%reason, "cannot see the cluster: /healthz answers 503");
                blind = true;
            }
            (true, None) => {
                tracing::info!("the API watches are current again");
                blind = false;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_primary_ipv4_is_the_first_internal_then_external_one() {
        let node = |addresses: &str| -> k8s_openapi::api::core::v1::Node {
            serde_json::from_str(&format!(
                r#"{{"metadata":{{"name":"n"}},"status":{{"addresses":[{addresses}]}}}}"#
            ))
            .unwrap()
        };
        let address = |kind: &str, ip: &str| format!(r#"{{"type":"{kind}","address":"{ip}"}}"#);
        let dual = node(
            &[
                address("Hostname", "n"),
                address("ExternalIP", "203.0.113.5"),
                address("InternalIP", "fd00::5"),
                address("InternalIP", "192.168.1.5"),
            ]
            .join(","),
        );
        assert_eq!(node_primary_ipv4(&dual), Some("192.168.1.5".parse().unwrap()));
        let external_only = node(&address("ExternalIP", "203.0.113.5"));
        assert_eq!(node_primary_ipv4(&external_only), Some("203.0.113.5".parse().unwrap()));
        assert_eq!(node_primary_ipv4(&node(&address("InternalIP", "fd00::5"))), None);
        assert_eq!(node_primary_ipv4(&node("")), None);
    }
}
