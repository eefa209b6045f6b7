//! Which endpoints a Service port uses: EndpointSlices merged by address and port, the traffic policies,
//! topology hints and the terminating fallback.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use k8s_openapi::jiff::Timestamp;
use tracing::debug;

use crate::k8s::manifest::{ManifestError, Sourced};
use crate::k8s::{ANNOTATION_LAST_CHANGE_TRIGGER_TIME, LABEL_HEADLESS, LABEL_SERVICE_NAME};
use crate::net::Protocol;

use super::ModelStats;
use super::frontend::{BackendAddr, ServiceName, Topology};
use super::service::{
    Filter, PortPlan, ServicePlan, has_label, label, namespace_of, parse_protocol, port_number, unusable,
};

/// An endpoint's conditions, with kube-proxy's defaults applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct EndpointState {
    pub(super) ready: bool,
    pub(super) serving: bool,
    pub(super) terminating: bool,
    /// `nodeName` is this node's.
    pub(super) local: bool,
    /// Its `hints.forNodes`, as this node reads them.
    pub(super) node_hint: Hint,
    /// Its `hints.forZones`, as this node (in its zone) reads them.
    pub(super) zone_hint: Hint,
}

/// One kind of topology hint of an endpoint, relative to this node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Hint {
    /// No hint of this kind.
    #[default]
    Absent,
    /// Hinted, but not for this node (or its zone).
    Elsewhere,
    /// Hinted for this node (or its zone).
    Here,
}

impl Hint {
    pub(super) fn of<'a>(hinted: Option<impl Iterator<Item = &'a str>>, here: Option<&str>) -> Hint {
        let Some(mut names) = hinted.map(Iterator::peekable) else { return Hint::Absent };
        if names.peek().is_none() {
            return Hint::Absent;
        }
        if here.is_some_and(|here| names.any(|name| name == here)) { Hint::Here } else { Hint::Elsewhere }
    }
}

impl EndpointState {
    /// Which of two copies of one endpoint wins: ready first, then one the terminating fallback could use,
    /// then serving, then local.
    pub(super) fn rank(self) -> (bool, bool, bool, bool) {
        (self.ready, self.serving && self.terminating, self.serving, self.local)
    }

    pub(super) fn fallback(self) -> bool {
        self.serving && self.terminating
    }
}

/// Keeps the better copy of an endpoint seen more than once.
pub(super) fn merge<K: Ord>(map: &mut BTreeMap<K, EndpointState>, key: K, state: EndpointState) {
    match map.entry(key) {
        Entry::Vacant(entry) => {
            entry.insert(state);
        }
        Entry::Occupied(mut entry) => {
            if state.rank() > entry.get().rank() {
                entry.insert(state);
            }
        }
    }
}

/// What one EndpointSlice contributes to its Service.
pub(super) struct SliceUse {
    /// (port name, target port, protocol) of the slice's valid ports.
    pub(super) ports: Vec<(String, u16, Protocol)>,
    /// Valid addresses of its endpoints (all of the slice's `addressType`), with their conditions.
    pub(super) endpoints: Vec<(IpAddr, EndpointState)>,
    /// The last-change-trigger-time annotation, parsed and as written.
    pub(super) trigger_time: Option<(Timestamp, String)>,
}

pub(super) fn use_slice<'a>(
    slice: &'a Sourced<EndpointSlice>,
    filter: &Filter,
    not_ours: &HashSet<ServiceName>,
    errors: &mut Vec<ManifestError>,
    seen: &mut HashMap<(String, String), &'a str>,
) -> Option<(ServiceName, SliceUse)> {
    let origin = slice.origin.as_str();
    let meta = &slice.object.metadata;
    let namespace = namespace_of(meta);
    let slice_name = meta.name.clone().unwrap_or_default();
    let object = format!("EndpointSlice {namespace}/{slice_name}");
    let service = programmed_service(slice, &namespace, &object, filter, not_ours, errors)?;
    if !is_first_definition(origin, namespace, slice_name, &object, errors, seen) {
        return None;
    }
    let error = |field: String, message: String| {
        ManifestError::new(origin, message).with_object(object.clone()).with_field(field)
    };
    let ports = slice_ports(slice, &object, errors, &error);
    let endpoints = slice_endpoints(slice, filter, &object, errors, &error);
    let trigger_time = trigger_time(slice, errors, &error);
    Some((service, SliceUse { ports, endpoints, trigger_time }))
}

/// The Service the slice belongs to, when kproxy programs that Service and the slice is IPv4 or IPv6.
fn programmed_service(
    slice: &Sourced<EndpointSlice>,
    namespace: &str,
    object: &str,
    filter: &Filter,
    not_ours: &HashSet<ServiceName>,
    errors: &mut Vec<ManifestError>,
) -> Option<ServiceName> {
    let meta = &slice.object.metadata;
    let Some(service) = label(meta, LABEL_SERVICE_NAME).filter(|service| !service.is_empty()) else {
        // kube-proxy logs this as an error (endpointSliceCacheKeys): a hand-written slice that forgot the
        // label would otherwise leave its Service without endpoints and nobody the wiser.
        let message = format!(
            "the EndpointSlice has no {LABEL_SERVICE_NAME} label, so it belongs to no Service; it is ignored"
        );
        errors.push(
            ManifestError::new(slice.origin.as_str(), message)
                .with_object(object)
                .with_field(format!("metadata.labels[{LABEL_SERVICE_NAME}]")),
        );
        return None;
    };
    let service = ServiceName { namespace: namespace.to_string(), name: service.to_string() };
    if has_label(meta, LABEL_HEADLESS) || !filter.slice_is_ours(meta) || not_ours.contains(&service) {
        debug!(slice = %object, "ignoring an EndpointSlice of a Service kproxy does not program");
        return None;
    }
    // kube-proxy's proxiers read slices of their own family only; FQDN slices are for no proxy.
    if !matches!(slice.object.address_type.as_str(), "IPv4" | "IPv6") {
        debug!(slice = %object, address_type = slice.object.address_type, "ignoring an EndpointSlice that is neither IPv4 nor IPv6");
        return None;
    }
    Some(service)
}

/// Remembers where a named slice was first defined; a later copy of the same name is reported and skipped.
fn is_first_definition<'a>(
    origin: &'a str,
    namespace: String,
    slice_name: String,
    object: &str,
    errors: &mut Vec<ManifestError>,
    seen: &mut HashMap<(String, String), &'a str>,
) -> bool {
    if slice_name.is_empty() {
        return true;
    }
    if let Some(first) = seen.get(&(namespace.clone(), slice_name.clone())) {
        let message = format!("the EndpointSlice is defined again (first in {first}); this copy is skipped");
        errors.push(ManifestError::new(origin, message).with_object(object));
        return false;
    }
    seen.insert((namespace, slice_name), origin);
    true
}

/// The slice's valid ports as (name, target port, protocol); an invalid number is reported.
fn slice_ports(
    slice: &Sourced<EndpointSlice>,
    object: &str,
    errors: &mut Vec<ManifestError>,
    error: &impl Fn(String, String) -> ManifestError,
) -> Vec<(String, u16, Protocol)> {
    let mut ports = Vec::new();
    for (i, port) in slice.object.ports.iter().flatten().enumerate() {
        let number = match port.port {
            Some(n) => match port_number(n) {
                Some(number) => number,
                None => {
                    let message = format!("port {n} is not in 1-65535; the port is ignored");
                    errors.push(error(format!("ports[{i}].port"), message));
                    continue;
                }
            },
            None => {
                let message = "the port number is missing; the port is ignored".to_string();
                errors.push(error(format!("ports[{i}].port"), message));
                continue;
            }
        };
        // An unsupported protocol was already reported on the Service's port.
        let Ok(proto) = parse_protocol(port.protocol.as_deref()) else {
            debug!(slice = %object, index = i, "ignoring an EndpointSlice port with an unsupported protocol");
            continue;
        };
        ports.push((port.name.clone().unwrap_or_default(), number, proto));
    }
    ports
}

/// The slice's usable endpoint addresses with their conditions; an unusable address is reported.
fn slice_endpoints(
    slice: &Sourced<EndpointSlice>,
    filter: &Filter,
    object: &str,
    errors: &mut Vec<ManifestError>,
    error: &impl Fn(String, String) -> ManifestError,
) -> Vec<(IpAddr, EndpointState)> {
    let ipv6 = slice.object.address_type == "IPv6";
    let mut endpoints = Vec::new();
    for (i, endpoint) in slice.object.endpoints.iter().enumerate() {
        let state = endpoint_state(endpoint, filter);
        if endpoint.addresses.len() > 1 {
            debug!(slice = %object, endpoint = i, "only addresses[0] of an endpoint is used, as kube-proxy does");
        }
        if let Some(text) = endpoint.addresses.first() {
            let j = 0;
            let field = || format!("endpoints[{i}].addresses[{j}]");
            let parsed = if ipv6 {
                text.parse::<Ipv6Addr>().map(IpAddr::V6)
            } else {
                text.parse::<Ipv4Addr>().map(IpAddr::V4)
            };
            match parsed {
                Ok(addr) => match unusable(addr) {
                    Some(what) => {
                        let message =
                            format!("{addr} is {what}, not a usable endpoint; the address is skipped");
                        errors.push(error(field(), message));
                    }
                    None => endpoints.push((addr, state)),
                },
                Err(_) => {
                    let family = if ipv6 { "IPv6" } else { "IPv4" };
                    let message = format!("{text:?} is not an {family} address; the address is skipped");
                    errors.push(error(field(), message));
                }
            }
        }
    }
    endpoints
}

/// An endpoint's conditions and hints as this node and zone read them.
fn endpoint_state(endpoint: &Endpoint, filter: &Filter) -> EndpointState {
    let conditions = endpoint.conditions.as_ref();
    let hints = endpoint.hints.as_ref();
    EndpointState {
        ready: conditions.and_then(|c| c.ready) != Some(false),
        serving: conditions.and_then(|c| c.serving) != Some(false),
        terminating: conditions.and_then(|c| c.terminating) == Some(true),
        local: filter.node_name.is_some() && endpoint.node_name.as_deref() == filter.node_name,
        node_hint: Hint::of(
            hints.and_then(|h| h.for_nodes.as_ref()).map(|nodes| nodes.iter().map(|n| n.name.as_str())),
            filter.node_name,
        ),
        zone_hint: Hint::of(
            hints.and_then(|h| h.for_zones.as_ref()).map(|zones| zones.iter().map(|z| z.name.as_str())),
            filter.zone,
        ),
    }
}

/// The last-change-trigger-time annotation, parsed; one that is not an RFC 3339 time is reported.
fn trigger_time(
    slice: &Sourced<EndpointSlice>,
    errors: &mut Vec<ManifestError>,
    error: &impl Fn(String, String) -> ManifestError,
) -> Option<(Timestamp, String)> {
    let meta = &slice.object.metadata;
    let annotation = meta.annotations.as_ref().and_then(|a| a.get(ANNOTATION_LAST_CHANGE_TRIGGER_TIME));
    annotation.and_then(|text| match text.parse::<Timestamp>() {
        Ok(time) => Some((time, text.clone())),
        Err(err) => {
            let message = format!("{text:?} is not an RFC 3339 time ({err}); it is ignored");
            let field = format!("metadata.annotations[{ANNOTATION_LAST_CHANGE_TRIGGER_TIME}]");
            errors.push(error(field, message));
            None
        }
    })
}

/// The endpoints of one Service port across its slices, merged, in their state as the Service sees them.
/// Slice ports are matched by name (absent and empty are equal) and must have the same protocol; the slice
/// port's number is the target port of that slice's endpoints.
pub(super) fn endpoints_for(
    plan: &ServicePlan,
    port: &PortPlan,
    slices: &[SliceUse],
) -> Vec<(BackendAddr, EndpointState)> {
    let mut merged = BTreeMap::new();
    for slice in slices {
        for (name, target, proto) in &slice.ports {
            if *name != port.name {
                continue;
            }
            if *proto != port.proto {
                debug!(service = %plan.name, port = name, "EndpointSlice port protocol differs from the Service port's; ignored");
                continue;
            }
            for &(addr, state) in &slice.endpoints {
                merge(&mut merged, BackendAddr { addr, port: *target }, state);
            }
        }
    }
    merged.into_iter().collect()
}

/// The endpoints one frontend entry uses.
pub(super) struct Selection {
    pub(super) backends: Vec<BackendAddr>,
    pub(super) terminating_fallback: bool,
    pub(super) terminating_backends: Vec<BackendAddr>,
    /// Only this node's endpoints were eligible.
    pub(super) local_only: bool,
    pub(super) topology: Topology,
    /// See [`Frontend::no_local_endpoints`].
    pub(super) no_local_endpoints: bool,
}

/// The backends among `endpoints` (sorted by address): the ready ones (narrowed by topology for a
/// cluster-wide selection), or the serving-and-terminating ones when none is ready; and the
/// serving-and-terminating ones left out of them (they keep their flows).
pub(super) fn select(endpoints: &[(BackendAddr, EndpointState)], local_only: bool) -> Selection {
    let pick = |keep: &dyn Fn(EndpointState) -> bool| -> Vec<BackendAddr> {
        endpoints
            .iter()
            .filter(|(_, state)| (!local_only || state.local) && keep(*state))
            .map(|(backend, _)| *backend)
            .collect()
    };
    let topology = if local_only { Topology::All } else { topology_of(endpoints) };
    let ready = pick(&|state| state.ready && topology.admits(state));
    let fallback = pick(&|state| !state.ready && state.fallback());
    if !ready.is_empty() {
        return Selection {
            backends: ready,
            terminating_fallback: false,
            terminating_backends: fallback,
            local_only,
            topology,
            no_local_endpoints: false,
        };
    }
    let used = !fallback.is_empty();
    let usable_anywhere = endpoints.iter().any(|(_, state)| state.ready || state.fallback());
    Selection {
        backends: fallback,
        terminating_fallback: used,
        terminating_backends: Vec::new(),
        local_only,
        // Topology is only chosen when a ready endpoint matches it, so an empty ready list means none did.
        topology: Topology::All,
        no_local_endpoints: local_only && !used && usable_anywhere,
    }
}

/// kube-proxy's `topologyModeFromHints`: node hints win when every ready endpoint has one and one is for
/// this node; then zone hints, likewise; else every endpoint. Endpoints that are not ready do not count.
pub(super) fn topology_of(endpoints: &[(BackendAddr, EndpointState)]) -> Topology {
    let ready: Vec<EndpointState> = endpoints.iter().map(|(_, state)| *state).filter(|s| s.ready).collect();
    let follows = |hint: fn(&EndpointState) -> Hint| {
        !ready.is_empty()
            && ready.iter().all(|s| hint(s) != Hint::Absent)
            && ready.iter().any(|s| hint(s) == Hint::Here)
    };
    if follows(|s| s.node_hint) {
        Topology::SameNode
    } else if follows(|s| s.zone_hint) {
        Topology::SameZone
    } else {
        Topology::All
    }
}

impl Topology {
    pub(super) fn admits(self, state: EndpointState) -> bool {
        match self {
            Topology::All => true,
            Topology::SameZone => state.zone_hint == Hint::Here,
            Topology::SameNode => state.node_hint == Hint::Here,
        }
    }
}

/// The distinct addresses of a Service's endpoints on this node (all slices and ports) that are ready,
/// and those that are serving and terminating but not ready, for its health check: of one family
/// (`ipv4`, or IPv6), so that a dual-stack pod is one endpoint, not two.
pub(super) fn local_endpoint_counts(slices: &[SliceUse], ipv4: bool) -> (usize, usize) {
    let mut ready = BTreeSet::new();
    let mut terminating = BTreeSet::new();
    for &(addr, state) in slices.iter().flat_map(|slice| &slice.endpoints) {
        if !state.local || addr.is_ipv4() != ipv4 {
            continue;
        }
        if state.ready {
            ready.insert(addr);
        } else if state.fallback() {
            terminating.insert(addr);
        }
    }
    (ready.len(), terminating.difference(&ready).count())
}

/// Adds a programmed Service's distinct endpoint addresses to the stats, each in its best state.
pub(super) fn count_endpoints(slices: &[SliceUse], stats: &mut ModelStats) {
    let mut merged = BTreeMap::new();
    for &(addr, state) in slices.iter().flat_map(|slice| &slice.endpoints) {
        merge(&mut merged, addr, state);
    }
    for state in merged.values() {
        if state.ready {
            stats.endpoints_ready += 1;
        } else if state.terminating {
            stats.endpoints_terminating += 1;
        } else {
            stats.endpoints_not_ready += 1;
        }
    }
}
