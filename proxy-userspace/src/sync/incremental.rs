//! The sync of an endpoint change: only the frontends the model says changed are diffed and written,
//! with what [`Syncer::apply`] would write for them, in its order. The steps of a full apply that span
//! frontends — a backend's flag (active when any frontend sends it new connections) and whether it is
//! an orphan — come from counts of the backends' uses, kept from one change to the next.

use std::collections::BTreeMap;

use proxy_common::maps::{BACKEND_FLAG_ACTIVE, BACKEND_FLAG_TERMINATING};

use super::{
    BackendEntry, FrontendKey, Store, SyncError, SyncReport, Syncer, affinity_id, cluster_ip_frontends,
};
use crate::model::{BackendAddr, Desired, Frontend, FrontendKind, cache::Changed};
use crate::net::Protocol;

/// How many frontends of the desired state name a backend: (as active, as terminating).
pub(super) type BackendUses = foldhash::HashMap<(BackendAddr, Protocol), (u32, u32)>;

fn count_uses(uses: &mut BackendUses, frontend: &Frontend, added: bool) {
    let mut count = |backend: &BackendAddr, active: bool| {
        let key = (*backend, frontend.proto);
        let entry = uses.entry(key).or_default();
        let field = if active { &mut entry.0 } else { &mut entry.1 };
        if added {
            *field += 1;
        } else {
            *field = field.saturating_sub(1);
        }
        if *entry == (0, 0) {
            uses.remove(&key);
        }
    };
    for backend in &frontend.backends {
        count(backend, true);
    }
    for backend in &frontend.terminating_backends {
        count(backend, false);
    }
}

fn uses_of<'a>(frontends: impl IntoIterator<Item = &'a Frontend>) -> BackendUses {
    let mut uses = BackendUses::default();
    for frontend in frontends {
        count_uses(&mut uses, frontend, true);
    }
    uses
}

impl<S: Store> Syncer<S> {
    /// Makes the maps hold `desired` when it differs from the state the last sync programmed only in
    /// `changed` (the model's [`Changed`]): the same writes as [`Syncer::apply`] of `desired`, for
    /// those frontends and their backends only. `None`, having written nothing, when the maps are not
    /// known to hold the last state (a write failed, or nothing was applied yet) or a changed frontend
    /// is not programmed: then [`Syncer::apply`] is the way.
    pub fn apply_changed(&mut self, desired: &Desired, changed: &Changed) -> Option<SyncReport> {
        if !self.in_step {
            return None;
        }
        let mut frontends: Vec<(FrontendKey, &Frontend)> = changed
            .frontends
            .iter()
            .map(|&at| desired.frontends.get(at).map(|f| (FrontendKey::of(f), f)))
            .collect::<Option<_>>()?;
        // In the maps' key order, as a full apply writes them (and hands out new backends' ids).
        frontends.sort_by_key(|(fk, _)| *fk);
        if frontends.iter().any(|(fk, _)| !self.frontends.contains_key(fk)) {
            return None;
        }
        let uses = match self.backend_uses.take() {
            Some(mut uses) => {
                for frontend in &changed.before {
                    count_uses(&mut uses, frontend, false);
                }
                for (_, frontend) in &frontends {
                    count_uses(&mut uses, frontend, true);
                }
                uses
            }
            None => uses_of(&desired.frontends),
        };
        // The backends whose flag or existence may have changed, and the flag each should carry.
        let mut touched: Vec<(BackendAddr, Protocol)> = changed
            .before
            .iter()
            .chain(frontends.iter().map(|(_, f)| *f))
            .flat_map(|f| f.backends.iter().chain(&f.terminating_backends).map(move |b| (*b, f.proto)))
            .collect();
        touched.sort();
        touched.dedup();
        let flags: BTreeMap<(BackendAddr, Protocol), u8> = touched
            .iter()
            .filter_map(|key| {
                let (active, _) = uses.get(key)?;
                Some((*key, if *active > 0 { BACKEND_FLAG_ACTIVE } else { BACKEND_FLAG_TERMINATING }))
            })
            .collect();

        let mut report = SyncReport::default();
        self.update_backend_flags(&flags, BACKEND_FLAG_ACTIVE, &mut report);
        // Every frontend of a changed Service is here, its cluster IPs among them (affinity ids).
        let cluster_ips = cluster_ip_frontends(frontends.iter().map(|(_, f)| *f));
        let cluster_ips_first = frontends
            .iter()
            .filter(|(_, f)| f.kind == FrontendKind::ClusterIp)
            .chain(frontends.iter().filter(|(_, f)| f.kind != FrontendKind::ClusterIp));
        for (fk, frontend) in cluster_ips_first {
            let name = format!("{}:{}", frontend.service, frontend.port_name);
            let affinity =
                affinity_id(frontend, &cluster_ips, |ck| self.frontends.get(ck).map(|p| p.rev_nat_id));
            if let Err(e) = self.apply_frontend(*fk, frontend, &name, affinity, &flags, &mut report) {
                report.errors.push(SyncError::frontend_not_programmed(fk, frontend, &e));
            }
        }
        self.update_backend_flags(&flags, BACKEND_FLAG_TERMINATING, &mut report);
        // No frontend names them any more: with every other frontend as the last sync left it, no
        // slot does either.
        for key in touched.iter().filter(|key| !uses.contains_key(key)) {
            let Some(BackendEntry { id, .. }) = self.backends.get(key).copied() else { continue };
            match self.del_backend_entry(id, key.0) {
                Ok(()) => {
                    self.backends.remove(key);
                    report.backends_removed += 1;
                    report.removed_backends.push((id, key.1));
                    report.removed_backend_addrs.push(*key);
                }
                Err(e) => report
                    .errors
                    .push(SyncError::BackendNotRemoved { backend: key.0, cause: format!("{e:#}") }),
            }
        }
        self.in_step = report.errors.is_empty();
        self.backend_uses = Some(uses);
        Some(report)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::k8s::kept::{Kept, decoded};
    use crate::k8s::manifest::parse_str;
    use crate::model::{ModelOptions, cache::ModelCache};
    use crate::sync::mem_store::MemStore;

    const SERVICES: &str = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.100
  sessionAffinity: ClientIP
  type: NodePort
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30080}]
---
apiVersion: v1
kind: Service
metadata: {name: api, namespace: default}
spec:
  clusterIP: 10.96.0.101
  ports: [{name: http, port: 80, protocol: TCP}]
";

    fn slice(service: &str, endpoints: &str) -> Arc<Kept<k8s_openapi::api::discovery::v1::EndpointSlice>> {
        let text = format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {service}-1, namespace: default, \
             labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: IPv4\nendpoints: [{endpoints}]\n\
             ports: [{{name: http, port: 8080, protocol: TCP}}]\n"
        );
        let parsed = parse_str(&text, "test.yaml");
        assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
        let slice = parsed.slices.into_iter().next().unwrap();
        Arc::new(Kept::compact(slice.origin, slice.object))
    }

    const TERMINATING: &str = "conditions: {ready: false, serving: true, terminating: true}";

    fn contents(store: &MemStore) -> String {
        format!(
            "{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}",
            store.services, store.backends, store.rev_nat, store.names, store.vips, store.source_ranges
        )
    }

    /// Endpoint changes applied alone leave the maps as a full apply of the same state does, with
    /// the same report: a backend two Services share turns terminating when the one that used it as
    /// ready lets it go, active again when it comes back, and goes when no Service names it.
    #[test]
    fn an_endpoint_change_applied_alone_writes_what_a_full_apply_writes() {
        let options =
            ModelOptions { node_addresses: vec!["192.168.1.10".parse().unwrap()], ..Default::default() };
        let parsed = parse_str(SERVICES, "test.yaml");
        let services: Vec<_> =
            parsed.services.into_iter().map(|s| Arc::new(Kept::compact(s.origin, s.object))).collect();
        let shared = format!("{{addresses: [10.244.0.11], {TERMINATING}}}");
        let mut slices = vec![
            slice("web", "{addresses: [10.244.0.11]}, {addresses: [10.244.0.12]}"),
            slice("api", &format!("{shared}, {{addresses: [10.244.0.13]}}")),
        ];
        let mut cache = ModelCache::default();
        let mut alone = Syncer::with_store(MemStore::default()).unwrap();
        let mut full = Syncer::with_store(MemStore::default()).unwrap();
        let first = cache.update(&services, &slices, &options);
        assert!(first.changed.is_none());
        assert_eq!(alone.apply(first.desired), full.apply(first.desired));

        let steps = [
            (0, "{addresses: [10.244.0.12]}".to_owned()),
            (
                0,
                "{addresses: [10.244.0.11]}, {addresses: [10.244.0.12]}, {addresses: [10.244.0.14]}"
                    .to_owned(),
            ),
            (1, "{addresses: [10.244.0.13]}".to_owned()),
            (0, "{addresses: [10.244.0.14]}".to_owned()),
            (0, String::new()),
            (1, shared.clone()),
        ];
        for (i, (which, endpoints)) in steps.iter().enumerate() {
            slices[*which] = slice(["web", "api"][*which], endpoints);
            let update = cache.update(&services, &slices, &options);
            let changed = update.changed.clone().expect("an endpoint change is patched in place");
            let (desired, _) = crate::model::build_with(&decoded(&services), &decoded(&slices), &options);
            assert_eq!(update.desired, &desired, "step {i}: the patched state is the full model's");
            let report = alone.apply_changed(update.desired, &changed).expect("in step");
            let expected = full.apply(update.desired);
            assert_eq!(report, expected, "step {i}");
            assert_eq!(contents(alone.store()), contents(full.store()), "step {i}");
            let has_11 = alone.store().backends.values().any(|b| b.addr == [10, 244, 0, 11]);
            assert_eq!(has_11, !matches!(i, 3 | 4), "step {i}: .11 is there while a Service names it");
        }
    }
}
