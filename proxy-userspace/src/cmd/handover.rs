//! The way back to kube-proxy (issue 17): before `kproxy unload` detaches the programs, the flows
//! kproxy translated are handed to netfilter, so that kube-proxy's restored rules carry them on.
//!
//! Without this, unloading cuts every connection kproxy translated. Its tc program DNATed the
//! client's packets before netfilter saw them, so nf_conntrack knows such a flow only untranslated
//! (client:port → backend), if at all. Once the program is gone the client's next packet goes to
//! the Service address: a new flow to netfilter, which kube-proxy's rules send to a backend of
//! their choice (another one: reset) and, when it is the same one, whose reply tuple the
//! untranslated entry already holds, so netfilter moves the client to another source port (the
//! backend sees a stranger: reset). The backend's replies, untranslated, reach a client socket
//! that talks to the Service address (reset again).
//!
//! The handover, for each open flow kproxy translated — DNATed from a pod, or DNATed and sent from
//! a node address and SNAT port (NodePort and external traffic) — while the programs still run, in
//! this order:
//! 1. delete nf_conntrack's untranslated entries of the flow (source → backend, and backend →
//!    source if the first packet netfilter saw was a reply), where the source is the client, or
//!    the node address and port kproxy sent a NodePort flow from;
//! 2. create netfilter's own NAT entry for it, as if kube-proxy's rules had chosen kproxy's backend
//!    (and masqueraded to kproxy's port): original client → Service, reply backend → source
//!    ([`nf_conntrack::create_dnat_from`]), its timeout what kproxy would have given the flow. A
//!    packet of the flow that passed in between made a new untranslated entry, which holds the
//!    reply tuple (EEXIST): delete it and retry;
//! 3. mark the flow inherited (`INHERITED_V4`, as the agent marks kube-proxy's flows when kproxy
//!    takes over), then delete kproxy's conntrack entries for it, forward first, and its SNAT_V4
//!    entries: from its next packet on XDP and tc pass the flow to netfilter, which translates it
//!    by that entry.
//!
//! A packet of a pod's flow is left to netfilter's clash handling only between steps 2 and 3
//! (microseconds per flow): kproxy still sends it to the backend, netfilter sees a new flow whose
//! reply tuple the created entry holds, and moves its source port. A NodePort flow's packets
//! bypass netfilter while kproxy translates them (XDP_TX, bpf_redirect), so none meets the entry
//! early. Detaching then changes nothing for a handed-over flow: netfilter already translates it.
//!
//! Not handed over (counted and named in the output): flows whose source port kproxy remapped (a
//! clash with another translated flow) and hairpin flows (a pod reaching itself through its
//! Service, source rewritten to the hairpin address). The same kind of entry, with that source,
//! would describe them, but no sandbox test covers them yet, so they break as without the
//! handover. Socket-level load balancing keeps no flow here: a connected socket talks to its
//! backend itself and goes on after the unload (getpeername and recvmsg then show the backend, not
//! the Service); an unconnected UDP socket's next `sendto` to the Service goes through kube-proxy's
//! rules as a new flow.
//!
//! Only when netfilter will translate (connection tracking loaded, a NAT hook and a rule that
//! turns conntrack on: kube-proxy's rules restored); otherwise the flows are left as they are, and
//! the output says that they break and that kube-proxy's rules should be restored first.

use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddrV4},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use proxy_common::{
    conntrack::{CtState, Timeouts},
    inherited::{NfTuple, keys},
    maps::{
        CT_DIR_FORWARD, CT_FLAG_DIRECT, CT_FLAG_HAIRPIN, CT_FLAG_REMAP, CT_FLAG_SNAT, CtEntryV4, CtKeyV4,
    },
};

use crate::{
    bpf::{
        Maps, PinDir,
        conntrack::{
            SnatIndex, delete, delete_snat, hairpin_addr, key_ord, monotonic_ns, pair_expired, read_config,
            read_conntrack, reply_key, snat_index, time_left_ns,
        },
    },
    net::Protocol,
    nf_conntrack::{self, DnatFlow, Entry, Tuple},
};

/// How many times an entry is created again after a packet re-created the untranslated one.
const CREATE_ATTEMPTS: usize = 5;

/// One of kproxy's flows as netfilter is to carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    pub proto: Protocol,
    pub client: SocketAddrV4,
    pub service: SocketAddrV4,
    pub backend: SocketAddrV4,
    /// Where the backend sees the flow come from: the client, or for a flow kproxy source-NATed
    /// (NodePort) the node address and SNAT port.
    pub source: SocketAddrV4,
    /// What kproxy would still have given the flow idle.
    pub timeout_secs: u32,
    forward_key: CtKeyV4,
    forward_entry: CtEntryV4,
    reply_key: CtKeyV4,
}

impl Flow {
    /// As the client sent it: client → Service.
    fn original(&self) -> Tuple {
        Tuple {
            src: *self.client.ip(),
            dst: *self.service.ip(),
            sport: self.client.port(),
            dport: self.service.port(),
        }
    }

    /// As netfilter saw it, if at all, while kproxy translated it: source → backend.
    fn untranslated(&self) -> Tuple {
        Tuple {
            src: *self.source.ip(),
            dst: *self.backend.ip(),
            sport: self.source.port(),
            dport: self.backend.port(),
        }
    }

    fn source_nated(&self) -> bool {
        self.forward_entry.flags & CT_FLAG_SNAT != 0
    }

    fn entry(&self, orig: Tuple) -> Entry {
        Entry {
            proto: self.proto,
            orig,
            reply: orig.inverse(),
            status: 0,
            tcp_state: None,
            timeout_secs: 0,
            mark: 0,
            zone: 0,
        }
    }
}

impl std::fmt::Display for Flow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} → {} (backend {})", self.proto, self.client, self.service, self.backend)?;
        if self.source != self.client {
            write!(f, " from {}", self.source)?;
        }
        Ok(())
    }
}

/// Why a flow kproxy translated is not handed to netfilter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum NotHanded {
    /// Sent from a node address and an SNAT port (NodePort, external traffic) that kproxy no longer
    /// knows (its SNAT_V4 entry is gone).
    SourceNated,
    /// Its source port was remapped (a clash with another translated flow).
    PortRemapped,
    /// A pod that reached itself through its Service.
    Hairpin,
}

impl NotHanded {
    fn explain(self) -> &'static str {
        match self {
            NotHanded::SourceNated => {
                "source-NATed by kproxy (NodePort or external traffic) with its node address and port lost"
            }
            NotHanded::PortRemapped => "with a source port kproxy remapped",
            NotHanded::Hairpin => "hairpin (a pod reaching itself through its Service)",
        }
    }
}

/// What to do with each of kproxy's open flows.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub flows: Vec<Flow>,
    pub not_handed: BTreeMap<NotHanded, usize>,
}

impl Plan {
    pub fn open_flows(&self) -> usize {
        self.flows.len() + self.not_handed.values().sum::<usize>()
    }
}

/// The flows of `entries` (CONNTRACK_V4) that are open at `now`, each to hand over or not.
pub fn plan(
    entries: &[(CtKeyV4, CtEntryV4)],
    hairpin: [u8; 4],
    snat: &SnatIndex,
    timeouts: &Timeouts,
    now: u64,
) -> Plan {
    let by_key: HashMap<_, &CtEntryV4> = entries.iter().map(|(k, e)| (key_ord(k), e)).collect();
    let mut plan = Plan::default();
    for (key, entry) in entries.iter().filter(|(k, _)| k.direction == CT_DIR_FORWARD) {
        let reply = reply_key(key, entry, hairpin, snat);
        let reply_entry = by_key.get(&key_ord(&reply)).copied();
        if pair_expired(timeouts, entry, reply_entry, now) || entry.state == CtState::Closed as u8 {
            continue;
        }
        let Some(proto) = Protocol::from_number(key.proto) else { continue };
        let addr = |a: [u8; 4], p: [u8; 2]| SocketAddrV4::new(Ipv4Addr::from(a), u16::from_be_bytes(p));
        let (client, source) = (addr(key.saddr, key.sport), addr(reply.daddr, reply.dport));
        let not_handed = if entry.flags & (CT_FLAG_REMAP | CT_FLAG_DIRECT) != 0 {
            Some(NotHanded::PortRemapped)
        } else if entry.flags & CT_FLAG_HAIRPIN != 0 {
            Some(NotHanded::Hairpin)
        } else if entry.flags & CT_FLAG_SNAT != 0 && source == client {
            Some(NotHanded::SourceNated)
        } else {
            None
        };
        if let Some(why) = not_handed {
            *plan.not_handed.entry(why).or_default() += 1;
            continue;
        }
        let left = time_left_ns(timeouts, entry, reply_entry, now);
        plan.flows.push(Flow {
            proto,
            client,
            service: addr(key.daddr, key.dport),
            backend: addr(entry.nat_addr, entry.nat_port),
            source,
            timeout_secs: u32::try_from(left.div_ceil(1_000_000_000)).unwrap_or(u32::MAX).max(1),
            forward_key: *key,
            forward_entry: *entry,
            reply_key: reply,
        });
    }
    plan
}

/// What the handover did.
#[derive(Debug, Default)]
pub struct Report {
    pub handed: BTreeMap<Protocol, usize>,
    pub not_handed: BTreeMap<NotHanded, usize>,
    pub failed: Vec<(Flow, String)>,
    /// Creations tried again because a packet had re-created the untranslated entry.
    pub retries: usize,
    /// The longest time a flow spent with netfilter's entry created while kproxy still
    /// translated it (steps 2 to 3), and the whole handover's.
    pub longest_window: Duration,
    pub elapsed: Duration,
}

impl Report {
    pub fn handed_total(&self) -> usize {
        self.handed.values().sum()
    }
}

fn nf_tuple(t: &Tuple) -> NfTuple {
    NfTuple {
        src: t.src.octets(),
        dst: t.dst.octets(),
        sport: t.sport.to_be_bytes(),
        dport: t.dport.to_be_bytes(),
    }
}

/// Steps 1 and 2: netfilter's own NAT entry in place of its untranslated ones. Returns the retries.
fn create_entry(flow: &Flow) -> Result<usize, String> {
    let dnat = DnatFlow {
        proto: flow.proto,
        client: flow.client,
        vip: flow.service,
        backend: flow.backend,
        timeout_secs: flow.timeout_secs,
        mark: 0,
        zone: 0,
    };
    for attempt in 0..CREATE_ATTEMPTS {
        let untranslated = flow.untranslated();
        for orig in [untranslated, untranslated.inverse()] {
            nf_conntrack::delete(&flow.entry(orig)).map_err(|e| e.to_string())?;
        }
        if nf_conntrack::create_dnat_from(&dnat, flow.source).map_err(|e| e.to_string())? {
            return Ok(attempt);
        }
    }
    // Handed over already (an earlier unload that stopped half-way)?
    let wanted_reply = flow.untranslated().inverse();
    let entries = nf_conntrack::dump_v4().map_err(|e| e.to_string())?;
    if entries.iter().any(|e| e.proto == flow.proto && e.orig == flow.original() && e.reply == wanted_reply) {
        return Ok(CREATE_ATTEMPTS);
    }
    Err(format!(
        "nf_conntrack kept refusing the entry (EEXIST {CREATE_ATTEMPTS} times): another entry holds {} or its reply",
        flow.original()
    ))
}

/// Step 3: the flow is netfilter's from its next packet on.
fn leave_to_netfilter(maps: &mut Maps, flow: &Flow) -> Result<()> {
    let reply = flow.untranslated().inverse();
    let (marks, n) = keys(flow.proto.number(), nf_tuple(&flow.original()), nf_tuple(&reply), true);
    let mut marks = marks[..n].to_vec();
    // The forward key first: it is what makes tc pass the flow.
    marks.sort_by_key(|(k, _)| k.direction != CT_DIR_FORWARD);
    for (key, value) in &marks {
        maps.inherited.insert(key, value, 0).context("writing INHERITED_V4")?;
    }
    delete(maps, &flow.forward_key)?;
    delete(maps, &flow.reply_key)?;
    if flow.source_nated() {
        delete_snat(maps, &flow.forward_key, &flow.forward_entry);
    }
    Ok(())
}

/// Hands every flow of `plan` to netfilter (of the calling thread's network namespace).
pub fn hand_over(maps: &mut Maps, plan: &Plan) -> Report {
    let started = Instant::now();
    let mut report = Report { not_handed: plan.not_handed.clone(), ..Report::default() };
    for flow in &plan.flows {
        let retries = match create_entry(flow) {
            Ok(retries) => retries,
            Err(e) => {
                report.failed.push((*flow, e));
                continue;
            }
        };
        report.retries += retries;
        let created = Instant::now();
        let left = leave_to_netfilter(maps, flow);
        report.longest_window = report.longest_window.max(created.elapsed());
        if let Err(e) = left {
            // kproxy still translates it: the entry would only make netfilter move its packets to
            // another source port.
            let _ = nf_conntrack::delete(&flow.entry(flow.original()));
            report.failed.push((*flow, format!("{e:#}")));
            continue;
        }
        *report.handed.entry(flow.proto).or_default() += 1;
    }
    report.elapsed = started.elapsed();
    report
}

/// Whether netfilter would translate the flows handed to it; `Err` says why not.
fn netfilter_translates() -> Result<Option<&'static str>, String> {
    if !nf_conntrack::is_available() {
        return Err("connection tracking (nf_conntrack) is not loaded".into());
    }
    match super::netfilter::nat_hooks_present() {
        Some(true) => Ok(None),
        Some(false) => {
            Err("no NAT rule is in this network namespace (kube-proxy's rules are not restored)".into())
        }
        // Handing over costs nothing then: unloaded, the flows break anyway unless it translates them.
        None => Ok(Some("whether netfilter translates could not be read (nft, iptables-legacy-save)")),
    }
}

/// `kproxy unload`'s first step, run while the programs are still attached: hands the open flows
/// to netfilter (unless `enabled` is false) and says what it did, line by line.
pub fn before_unload(pins: &PinDir, enabled: bool) -> String {
    let mut out = String::new();
    let mut maps = match Maps::from_pins(pins) {
        Ok(maps) => maps,
        Err(e) => {
            let _ = writeln!(
                out,
                "handover: kproxy's maps could not be opened ({e:#}); no flow handed to netfilter"
            );
            return out;
        }
    };
    let entries = match read_conntrack(&maps) {
        Ok(entries) => entries,
        Err(e) => {
            let _ = writeln!(out, "handover: {e:#}; no flow handed to netfilter");
            return out;
        }
    };
    let config = read_config(&maps);
    let plan = plan(
        &entries,
        hairpin_addr(&config),
        &snat_index(&maps),
        &Timeouts::from_config(&config),
        monotonic_ns(),
    );
    if plan.open_flows() == 0 {
        out.push_str("handover: no open flow translated by kproxy\n");
        return out;
    }
    let breaking = |why: &str| {
        format!(
            "handover: {why}: the {} open flow(s) kproxy translated lose their translation when it unloads (their \
             connections break)\n",
            plan.open_flows()
        )
    };
    if !enabled {
        out.push_str(&breaking("not handing flows to netfilter (--no-handover)"));
        return out;
    }
    match netfilter_translates() {
        Err(why) => {
            out.push_str(&breaking(&format!("netfilter would not translate them: {why}")));
            out.push_str(
                "handover: restore kube-proxy's rules first, then `kproxy unload` hands them to netfilter\n",
            );
            return out;
        }
        Ok(Some(note)) => {
            let _ = writeln!(out, "handover: {note}; handing the flows over anyway");
        }
        Ok(None) => {}
    }
    let report = hand_over(&mut maps, &plan);
    out.push_str(&render(&report));
    out
}

fn render(report: &Report) -> String {
    let mut out = String::new();
    let per_proto: Vec<String> = report.handed.iter().map(|(p, n)| format!("{n} {p}")).collect();
    let _ = writeln!(
        out,
        "handover: handed {} flow(s) kproxy translated to netfilter (nf_conntrack){}{}",
        report.handed_total(),
        if per_proto.is_empty() { String::new() } else { format!(": {}", per_proto.join(", ")) },
        if report.handed_total() > 0 { "; netfilter translates them from now on" } else { "" }
    );
    if report.handed_total() > 0 {
        let _ = writeln!(
            out,
            "handover: took {:.1} ms; each flow was both kproxy's and netfilter's for at most {} µs; {} \
             creation(s) retried after a packet re-created netfilter's untranslated entry",
            report.elapsed.as_secs_f64() * 1e3,
            report.longest_window.as_micros(),
            report.retries
        );
    }
    for (why, n) in &report.not_handed {
        let _ = writeln!(
            out,
            "handover: not handed over: {n} flow(s) {}: their connections break when kproxy unloads",
            why.explain()
        );
    }
    if !report.failed.is_empty() {
        let (flow, error) = &report.failed[0];
        let _ = writeln!(
            out,
            "handover: FAILED for {} flow(s) (their connections break when kproxy unloads); first: {flow}: {error}",
            report.failed.len()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::conntrack::NO_SNAT;
    use crate::testutil::conntrack::*;
    use proxy_common::maps::{IPPROTO_TCP, IPPROTO_UDP};

    const S: u64 = 1_000_000_000;
    const NOW: u64 = 1000 * S;

    #[test]
    fn an_open_dnat_flow_is_handed_over_with_the_time_kproxy_had_left_for_it() {
        let udp = flow(CLIENT, 40053, IPPROTO_UDP, CtState::Open, NOW - 15 * S, NOW - 20 * S);
        let tcp = flow(CLIENT, 41000, IPPROTO_TCP, CtState::Established, NOW - S / 2, NOW - S);
        let entries = [udp[0], udp[1], tcp[0], tcp[1]];
        let plan = plan(&entries, HAIRPIN, &NO_SNAT, &Timeouts::DEFAULT, NOW);
        assert!(plan.not_handed.is_empty());
        assert_eq!(plan.flows.len(), 2);
        let udp_flow = plan.flows.iter().find(|f| f.proto == Protocol::Udp).unwrap();
        assert_eq!(udp_flow.client, SocketAddrV4::new(Ipv4Addr::from(CLIENT), 40053));
        assert_eq!(udp_flow.service, SocketAddrV4::new(Ipv4Addr::from(VIP), 53));
        assert_eq!(udp_flow.backend, SocketAddrV4::new(Ipv4Addr::from(BACKEND), 53));
        // Idle 15 s (the later of its two entries) of UDP's 60 s.
        assert_eq!(udp_flow.timeout_secs, 45);
        assert_eq!((udp_flow.forward_key, udp_flow.reply_key), (udp[0].0, udp[1].0));
        let tcp_flow = plan.flows.iter().find(|f| f.proto == Protocol::Tcp).unwrap();
        assert_eq!(tcp_flow.timeout_secs, 6 * 3600);
        assert_eq!(
            (tcp_flow.untranslated().dst, tcp_flow.original().dst),
            (Ipv4Addr::from(BACKEND), Ipv4Addr::from(VIP))
        );
    }

    #[test]
    fn flows_that_are_over_are_not_counted() {
        let expired = flow(CLIENT, 40000, IPPROTO_UDP, CtState::Open, NOW - 61 * S, NOW - 61 * S);
        let reset = flow(CLIENT, 40001, IPPROTO_TCP, CtState::Closed, NOW, NOW);
        let entries = [expired[0], expired[1], reset[0], reset[1]];
        let plan = plan(&entries, HAIRPIN, &NO_SNAT, &Timeouts::DEFAULT, NOW);
        assert_eq!(plan, Plan::default());
        assert_eq!(plan.open_flows(), 0);
    }

    #[test]
    fn source_nated_remapped_and_hairpin_flows_are_counted_not_handed() {
        let mut entries = Vec::new();
        for (port, flags) in
            [(1, CT_FLAG_SNAT), (2, CT_FLAG_REMAP), (3, CT_FLAG_REMAP | CT_FLAG_DIRECT), (4, CT_FLAG_HAIRPIN)]
        {
            let mut pair = flow(CLIENT, 40000 + port, IPPROTO_TCP, CtState::Established, NOW, NOW);
            pair[0].1.flags = flags;
            pair[1].1.flags = flags;
            entries.extend(pair);
        }
        let plan = plan(&entries, HAIRPIN, &NO_SNAT, &Timeouts::DEFAULT, NOW);
        assert!(plan.flows.is_empty());
        assert_eq!(
            plan.not_handed,
            BTreeMap::from([
                (NotHanded::SourceNated, 1),
                (NotHanded::PortRemapped, 2),
                (NotHanded::Hairpin, 1)
            ])
        );
        assert_eq!(plan.open_flows(), 4);
        let report = Report { not_handed: plan.not_handed.clone(), ..Report::default() };
        let text = render(&report);
        assert!(text.contains("handed 0 flow(s)"), "{text}");
        assert!(text.contains("2 flow(s) with a source port kproxy remapped"), "{text}");
    }

    #[test]
    fn a_source_nated_flow_is_handed_over_from_kproxy_s_node_address_and_port() {
        let node = [192, 168, 0, 1];
        let mut pair = flow(CLIENT, 51000, IPPROTO_TCP, CtState::Established, NOW, NOW);
        pair[0].1.flags = CT_FLAG_SNAT;
        let snat: SnatIndex = BTreeMap::from([(
            key_ord(&pair[0].0),
            proxy_common::maps::SnatEntryV4 {
                addr: node,
                port: 61000u16.to_be_bytes(),
                ..Default::default()
            },
        )]);
        let plan = plan(&[pair[0]], HAIRPIN, &snat, &Timeouts::DEFAULT, NOW);
        assert!(plan.not_handed.is_empty());
        let flow = plan.flows[0];
        assert_eq!(flow.source, SocketAddrV4::new(Ipv4Addr::from(node), 61000));
        assert_eq!(flow.client, SocketAddrV4::new(Ipv4Addr::from(CLIENT), 51000));
        assert!(flow.source_nated());
        assert_eq!(
            flow.untranslated(),
            Tuple { src: Ipv4Addr::from(node), dst: Ipv4Addr::from(BACKEND), sport: 61000, dport: 53 }
        );
        assert_eq!((flow.reply_key.saddr, flow.reply_key.daddr), (BACKEND, node));
        assert!(flow.to_string().ends_with("from 192.168.0.1:61000"), "{flow}");
    }

    #[test]
    fn a_flow_without_its_reply_entry_is_still_handed_over() {
        let tcp = flow(CLIENT, 41000, IPPROTO_TCP, CtState::Established, NOW - S, 0);
        let plan = plan(&[tcp[0]], HAIRPIN, &NO_SNAT, &Timeouts::DEFAULT, NOW);
        assert_eq!(plan.flows.len(), 1);
        assert_eq!(plan.flows[0].reply_key, tcp[1].0);
    }

    #[test]
    fn the_report_names_what_was_handed_per_protocol() {
        let report =
            Report { handed: BTreeMap::from([(Protocol::Tcp, 2), (Protocol::Udp, 1)]), ..Report::default() };
        let text = render(&report);
        assert!(
            text.starts_with(
                "handover: handed 3 flow(s) kproxy translated to netfilter (nf_conntrack): 2 TCP, 1 UDP;"
            ),
            "{text}"
        );
    }
}
