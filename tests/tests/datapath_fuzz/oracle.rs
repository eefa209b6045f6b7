//! The fuzzer's model of the cluster's flows, built only from what the programs were observed to
//! do and the Services as configured — never from the datapath's maps or code.
//!
//! A *flow* is a translation some program was seen to make: the tuple the client sent (`orig`)
//! and the tuple that left (`wire`). The reply tuple (`wire` reversed) is *owned* by the newest
//! flow that produced it; a packet with an owned tuple travelling back must become `orig`
//! reversed, and one with an unowned tuple must not change. Each hop of a packet is judged by the
//! rules below, which allow every outcome a correct proxy may produce (a remapped source port
//! where a reply tuple clashes, a closed flow yielding its tuple, a drop of an invalid segment)
//! and nothing else.

use std::collections::HashMap;

use super::{
    frame::{ACK, FIN, Fields, Kind, PSH, Part, RST, SYN, TCP, Tuple, UDP, URG, flags_name},
    topology::{Config, HAIRPIN, NODE, SNAT_RANGE, in_cluster_cidr, is_remote_pod, unanswerable},
};

/// Where a program ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hop {
    /// `kproxy_ingress` on a pod's host veth: packets leaving the pod.
    PodIngress,
    /// `kproxy_egress` on a pod's host veth: packets entering the pod.
    PodEgress,
    /// `kproxy_xdp` on the external interface.
    ExternalXdp,
    /// `kproxy_external_ingress` on the external interface.
    ExternalTc,
    /// `kproxy_egress` on the external interface: packets leaving the node.
    ExternalEgress,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Drop,
    /// Sent out of an interface by the program (bpf_redirect, XDP_REDIRECT/TX).
    Redirect,
}

/// What a hop did to a packet, after the checks every rewrite must pass.
#[derive(Clone, Debug)]
pub enum Observed {
    Dropped,
    /// Passed on with every field as it was.
    Untouched,
    Changed {
        verdict: Verdict,
        fields: Fields,
        bounce: bool,
    },
    /// Replaced by a refusal (a TCP RST, an ICMP port unreachable) sent back to the sender.
    Refusal {
        frame: Vec<u8>,
        bounce: bool,
    },
}

impl std::fmt::Display for Observed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Observed::Dropped => write!(f, "dropped"),
            Observed::Untouched => write!(f, "passed untouched"),
            Observed::Changed { verdict, fields, bounce } => {
                write!(f, "rewritten to {fields} ({verdict:?}{})", if *bounce { ", bounced" } else { "" })
            }
            Observed::Refusal { frame, .. } => write!(f, "answered with {}", super::frame::describe(frame)),
        }
    }
}

/// An invariant a hop broke: `check` names the invariant (one report per check and run).
#[derive(Clone, Debug)]
pub struct Fail {
    pub check: &'static str,
    pub detail: String,
}

pub fn fail<T>(check: &'static str, detail: impl Into<String>) -> Result<T, Fail> {
    Err(Fail { check, detail: detail.into() })
}

/// Netfilter's valid TCP flag combinations (ECE, CWR and PSH aside): anything else is INVALID,
/// which kube-proxy drops.
pub fn tcp_valid(flags: u8) -> bool {
    let f = flags & !(0x40 | 0x80 | PSH);
    [SYN, SYN | URG, SYN | ACK, RST, RST | ACK, FIN | ACK, FIN | ACK | URG, ACK, ACK | URG].contains(&f)
}

/// Whether a packet may start a flow: any UDP datagram, a TCP segment with SYN and none of
/// ACK, RST, FIN.
pub fn starts_flow(proto: u8, flags: u8) -> bool {
    proto == UDP || flags & (SYN | ACK | RST | FIN) == SYN
}

fn in_snat_range(port: u16) -> bool {
    (SNAT_RANGE.0..=SNAT_RANGE.1).contains(&port)
}

#[derive(Clone, Debug)]
pub struct Flow {
    pub orig: Tuple,
    pub wire: Tuple,
    /// The Service it was translated for; `None` for a direct flow whose source port was remapped.
    pub service: Option<&'static str>,
    pub hairpin: bool,
    /// Source-NATed to the node address.
    pub snat: bool,
    /// Its source port was remapped (only the port; the address stays the client's).
    pub remapped: bool,
    pub fin_forward: bool,
    pub fin_reply: bool,
    pub rst: bool,
    /// The flow was over and a packet it cannot be told apart from came by: the datapath may
    /// have dropped its translation or kept it.
    pub maybe_yielded: bool,
    /// A UDP flow whose backend left its Service at some point since it started: the datapath
    /// moves it (as kube-proxy's clean-up of stale UDP entries does), even if the backend came
    /// back (under another backend id).
    pub backend_lost: bool,
    pub alive: bool,
    pub started_at: u64,
}

impl Flow {
    /// A TCP flow that saw a FIN or a RST: it may yield its reply tuple to a new flow.
    pub fn over(&self) -> bool {
        self.orig.proto == TCP && (self.rst || self.fin_forward || self.fin_reply)
    }

    pub fn live(&self) -> bool {
        !self.over() && !self.maybe_yielded
    }

    pub fn reply(&self) -> Tuple {
        self.wire.reverse()
    }

    pub fn describe(&self) -> String {
        let mut s = format!("[{:?}] → [{:?}]", self.orig, self.wire);
        if let Some(svc) = self.service {
            s += &format!(" for Service {svc}");
        } else {
            s += " (direct, source port remapped)";
        }
        for (on, what) in [
            (self.hairpin, "hairpin"),
            (self.snat, "SNAT"),
            (self.remapped && self.service.is_some(), "remapped"),
            (self.over(), "over"),
            (self.maybe_yielded, "maybe yielded"),
        ] {
            if on {
                s += &format!(", {what}");
            }
        }
        s + &format!(", started at event {}", self.started_at)
    }
}

#[derive(Clone, Copy, Debug)]
enum Owner {
    Flow(usize),
    /// The newest packet with this reply tuple's forward tuple went untranslated.
    Direct,
}

/// RFC 791's reassembly key: source, destination, identification, protocol.
type DatagramKey = ([u8; 4], [u8; 4], u16, u8);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    Pod,
    External,
}

pub struct Oracle {
    pub config: Config,
    pub flows: Vec<Flow>,
    /// Alive flows, for the generator to answer and continue.
    pub alive: Vec<usize>,
    alive_at: HashMap<usize, usize>,
    by_orig: HashMap<Tuple, usize>,
    owners: HashMap<Tuple, Owner>,
    /// RFC 791's reassembly key → the ports of the newest first fragment seen with it.
    fragment_ports: HashMap<DatagramKey, (u16, u16)>,
    pub event: u64,
}

impl Oracle {
    /// The Services change: UDP flows whose backend left remember it.
    pub fn reconfigure(&mut self, config: Config) {
        self.config = config;
        for flow in &mut self.flows {
            if flow.orig.proto == UDP
                && flow.service.is_some()
                && !self.config.backend_current(flow.wire.dst, flow.wire.dport, UDP)
            {
                flow.backend_lost = true;
            }
        }
    }

    pub fn new(config: Config) -> Self {
        Self {
            config,
            flows: Vec::new(),
            alive: Vec::new(),
            alive_at: HashMap::new(),
            by_orig: HashMap::new(),
            owners: HashMap::new(),
            fragment_ports: HashMap::new(),
            event: 0,
        }
    }

    fn flow_owner(&self, reply: &Tuple) -> Option<usize> {
        match self.owners.get(reply) {
            Some(Owner::Flow(id)) => Some(*id),
            _ => None,
        }
    }

    fn add_flow(&mut self, flow: Flow) -> usize {
        let id = self.flows.len();
        debug_assert!(self.flow_owner(&flow.reply()).is_none());
        if let Some(old) = self.by_orig.get(&flow.orig).copied() {
            self.remove_flow(old);
        }
        self.by_orig.insert(flow.orig, id);
        self.owners.insert(flow.reply(), Owner::Flow(id));
        self.alive_at.insert(id, self.alive.len());
        self.alive.push(id);
        self.flows.push(flow);
        id
    }

    fn remove_flow(&mut self, id: usize) {
        let flow = &mut self.flows[id];
        if !flow.alive {
            return;
        }
        flow.alive = false;
        let (orig, reply) = (flow.orig, flow.reply());
        if self.by_orig.get(&orig) == Some(&id) {
            self.by_orig.remove(&orig);
        }
        if matches!(self.owners.get(&reply), Some(Owner::Flow(o)) if *o == id) {
            self.owners.remove(&reply);
        }
        let at = self.alive_at.remove(&id).unwrap();
        self.alive.swap_remove(at);
        if at < self.alive.len() {
            self.alive_at.insert(self.alive[at], at);
        }
    }

    fn new_flow(&mut self, orig: Tuple, wire: Tuple, service: Option<&'static str>) -> Flow {
        Flow {
            orig,
            wire,
            service,
            hairpin: false,
            snat: false,
            remapped: false,
            fin_forward: false,
            fin_reply: false,
            rst: false,
            maybe_yielded: false,
            backend_lost: false,
            alive: true,
            started_at: self.event,
        }
    }

    /// A FIN or RST seen on a flow, whatever became of the packet (a dropped segment may
    /// still have moved the datapath's state).
    fn note_flags(&mut self, tuple: &Tuple, flags: u8) {
        if tuple.proto != TCP || flags & (FIN | RST) == 0 {
            return;
        }
        let forward = self.by_orig.get(tuple).copied().map(|id| (id, true));
        let reply = self.flow_owner(tuple).map(|id| (id, false));
        for (id, is_forward) in [forward, reply].into_iter().flatten() {
            let f = &mut self.flows[id];
            f.rst |= flags & RST != 0;
            if flags & FIN != 0 {
                if is_forward {
                    f.fin_forward = true;
                } else {
                    f.fin_reply = true;
                }
            }
        }
    }

    /// Judges one hop: `kind` and `fields` describe the frame that went in.
    pub fn check(
        &mut self,
        hop: Hop,
        input: &[u8],
        kind: &Kind,
        fields: Option<Fields>,
        obs: &Observed,
    ) -> Result<(), Fail> {
        if let Kind::L4 { tuple, part: Part::First, .. } = kind {
            self.fragment_ports.insert(
                (tuple.src, tuple.dst, super::frame::ipv4(input).unwrap().id, tuple.proto),
                (tuple.sport, tuple.dport),
            );
        }
        match kind {
            Kind::NotIpv4 | Kind::OtherIpv4 => untouched(obs, "a packet no proxy translates was changed"),
            Kind::Malformed => match obs {
                Observed::Untouched | Observed::Dropped => Ok(()),
                _ => fail("malformed packet changed", format!("it was {obs}")),
            },
            Kind::L4 { tuple, flags, part } => {
                self.note_flags(tuple, *flags);
                match hop {
                    Hop::PodIngress => self.pod_ingress(tuple, *flags, *part, input, obs),
                    Hop::PodEgress | Hop::ExternalEgress => self.egress(tuple, *flags, obs),
                    Hop::ExternalTc => self.external_ingress(tuple, *flags, *part, input, obs),
                    Hop::ExternalXdp => match obs {
                        Observed::Untouched => Ok(()),
                        Observed::Changed { verdict: Verdict::Pass, .. } => {
                            fail("XDP_PASS with a changed frame", format!("it was {obs}"))
                        }
                        _ => self.external_ingress(tuple, *flags, *part, input, obs),
                    },
                }
            }
            Kind::LaterFragment { src, dst, proto, id } => {
                self.later_fragment(hop, *src, *dst, *proto, *id, fields.unwrap(), obs)
            }
            Kind::IcmpError { outer_src, outer_dst, quote, quote_has_options } => {
                self.icmp_error(hop, *outer_src, *outer_dst, quote, *quote_has_options, obs)
            }
        }
    }

    fn pod_ingress(
        &mut self,
        t: &Tuple,
        flags: u8,
        part: Part,
        input: &[u8],
        obs: &Observed,
    ) -> Result<(), Fail> {
        if t.dst == HAIRPIN {
            return self.hairpin_reply(t, flags, obs);
        }
        if let Some(id) = self.flow_owner(t)
            && self.flows[id].snat
        {
            return self.snat_reply(id, flags, obs);
        }
        if let Some(&id) = self.by_orig.get(t) {
            return self.known_forward(id, t, flags, part, input, obs, Side::Pod);
        }
        self.fresh_forward(t, flags, part, input, obs, Side::Pod)
    }

    fn external_ingress(
        &mut self,
        t: &Tuple,
        flags: u8,
        part: Part,
        input: &[u8],
        obs: &Observed,
    ) -> Result<(), Fail> {
        if let Some(id) = self.flow_owner(t) {
            if self.flows[id].snat {
                return self.snat_reply(id, flags, obs);
            }
            // The reply of a pod's flow, on its way to the pod's veth (which un-NATs it).
            return match obs {
                Observed::Untouched => Ok(()),
                Observed::Dropped if t.proto == TCP && !tcp_valid(flags) => Ok(()),
                _ => fail(
                    "reply to a pod's flow changed on the external interface",
                    format!("the reply of {} was {obs}", self.flows[id].describe()),
                ),
            };
        }
        if let Some(&id) = self.by_orig.get(t) {
            return self.known_forward(id, t, flags, part, input, obs, Side::External);
        }
        self.fresh_forward(t, flags, part, input, obs, Side::External)
    }

    #[allow(clippy::too_many_arguments)]
    fn known_forward(
        &mut self,
        id: usize,
        t: &Tuple,
        flags: u8,
        part: Part,
        input: &[u8],
        obs: &Observed,
        side: Side,
    ) -> Result<(), Fail> {
        let f = self.flows[id].clone();
        let expected = Fields::of_tuple(&f.wire);
        if let Observed::Changed { verdict, fields, bounce } = obs
            && *fields == expected
            && forward_verdict_ok(&f, *verdict, *bounce)
        {
            self.flows[id].maybe_yielded = false;
            return Ok(());
        }
        let udp_backend_gone = t.proto == UDP
            && f.service.is_some()
            && (f.backend_lost || !self.config.backend_current(f.wire.dst, f.wire.dport, UDP));
        let restart =
            (t.proto == TCP && starts_flow(TCP, flags) && f.over()) || f.maybe_yielded || udp_backend_gone;
        if restart {
            self.remove_flow(id);
            return self.fresh_forward(t, flags, part, input, obs, side).map_err(|mut e| {
                e.detail += &format!(
                    " (or, continuing {}, it should have been rewritten to {expected})",
                    f.describe()
                );
                e
            });
        }
        if matches!(obs, Observed::Dropped) && t.proto == TCP && !tcp_valid(flags) {
            return Ok(());
        }
        fail(
            "packet of a translated flow not translated as its flow",
            format!(
                "{} [{}] should have been rewritten to {expected} as {}, but was {obs}",
                format_args!("{t:?}"),
                flags_name(flags),
                f.describe()
            ),
        )
    }

    /// A packet no known flow claims.
    fn fresh_forward(
        &mut self,
        t: &Tuple,
        flags: u8,
        part: Part,
        input: &[u8],
        obs: &Observed,
        side: Side,
    ) -> Result<(), Fail> {
        if let Some(service) = self.config.frontend(t.dst, t.dport, t.proto).cloned() {
            return self.start_flow(&service, t, flags, part, input, obs, side);
        }
        if self.config.is_cluster_ip(t.dst) {
            return self.refusal(t, flags, input, obs, "a port the Service does not have");
        }
        self.direct(t, flags, obs, side)
    }

    #[allow(clippy::too_many_arguments)]
    fn start_flow(
        &mut self,
        service: &super::topology::Service,
        t: &Tuple,
        flags: u8,
        _part: Part,
        input: &[u8],
        obs: &Observed,
        side: Side,
    ) -> Result<(), Fail> {
        if service.backends.is_empty() {
            return self.refusal(t, flags, input, obs, "a Service without endpoints");
        }
        if !starts_flow(t.proto, flags) {
            return match obs {
                Observed::Dropped => Ok(()),
                _ => fail(
                    "segment that cannot start a flow not dropped",
                    format!(
                        "{t:?} [{}] to Service {} (no flow known) was {obs}: translating it starts a flow \
                         mid-stream, passing it leaks it",
                        flags_name(flags),
                        service.name
                    ),
                ),
            };
        }
        let (verdict, fields, bounce) = match obs {
            Observed::Changed { verdict, fields, bounce } => (*verdict, *fields, *bounce),
            _ => {
                return fail(
                    "new flow to a Service with endpoints not translated",
                    format!("{t:?} [{}] to Service {} was {obs}", flags_name(flags), service.name),
                );
            }
        };
        let (sport, dport) = fields.ports.unwrap();
        let backend = (fields.dst, dport);
        if !service.backends.contains(&backend) {
            return fail(
                "translated destination not among the Service's backends",
                format!("{t:?} to Service {} went to {}:{dport}", service.name, super::frame::ip(fields.dst)),
            );
        }
        let hairpin = side == Side::Pod && fields.dst == t.src;
        let snat = side == Side::External && fields.src == NODE;
        let shape_ok = if hairpin {
            // A remapped port too when another flow has the hairpin reply tuple.
            fields.src == HAIRPIN
                && (sport == t.sport || in_snat_range(sport))
                && verdict == Verdict::Redirect
                && bounce
        } else if snat {
            in_snat_range(sport) && verdict == Verdict::Redirect
        } else {
            fields.src == t.src && (sport == t.sport || in_snat_range(sport)) && verdict == Verdict::Pass
        };
        if !shape_ok {
            return fail(
                "new flow's source translated wrongly",
                format!("{t:?} to Service {} was {obs}", service.name),
            );
        }
        let masqueraded = !service.node_port && !in_cluster_cidr(t.src);
        if side == Side::External && !snat && (is_remote_pod(fields.dst) || masqueraded) {
            return fail(
                "external flow not source-NATed where replies would bypass the node",
                format!("{t:?} to Service {} was {obs}", service.name),
            );
        }
        let wire = Tuple::new(fields.src, sport, fields.dst, dport, t.proto);
        let remapped = !snat && sport != t.sport;
        if remapped {
            let client = if hairpin { HAIRPIN } else { t.src };
            let natural = Tuple::new(fields.dst, dport, client, t.sport, t.proto);
            if self.flow_owner(&natural).is_none() {
                return fail(
                    "source port remapped without a clash",
                    format!(
                        "{t:?} to Service {} was {obs}, but no flow has the reply tuple {natural:?}",
                        service.name
                    ),
                );
            }
        }
        if let Some(g) = self.flow_owner(&wire.reverse()) {
            let other = self.flows[g].clone();
            if remapped || snat || other.live() {
                return fail(
                    if hairpin {
                        "hairpin flow took the reply tuple of a live flow"
                    } else if remapped || snat {
                        "translated source port already in use"
                    } else {
                        "new flow took the reply tuple of a live translated flow"
                    },
                    format!(
                        "{t:?} to Service {} became {wire:?}, whose replies {:?} belong to live flow {}: they \
                         will be un-NATed for one of the two only",
                        service.name,
                        wire.reverse(),
                        other.describe()
                    ),
                );
            }
            self.remove_flow(g);
        }
        let mut flow = self.new_flow(*t, wire, Some(service.name));
        flow.hairpin = hairpin;
        flow.snat = snat;
        flow.remapped = remapped;
        self.add_flow(flow);
        Ok(())
    }

    /// A packet for which a refusal (or a drop) is right: never answered to an address that
    /// cannot be answered, nor for a RST.
    fn refusal(&mut self, t: &Tuple, flags: u8, input: &[u8], obs: &Observed, why: &str) -> Result<(), Fail> {
        let may_answer = !unanswerable(t.src) && (t.proto != TCP || flags & RST == 0);
        match obs {
            Observed::Dropped => Ok(()),
            Observed::Untouched if unanswerable(t.src) => Ok(()),
            Observed::Refusal { frame, bounce } if may_answer => valid_refusal(t, input, frame, *bounce),
            Observed::Refusal { .. } => fail(
                "refusal sent where none may be",
                format!("{t:?} [{}] to {why} was {obs}", flags_name(flags)),
            ),
            _ => fail(
                "packet to a cluster IP neither refused nor dropped",
                format!("{t:?} [{}] to {why} was {obs}", flags_name(flags)),
            ),
        }
    }

    /// A packet to no Service: untouched, unless its reply tuple is a translated flow's.
    fn direct(&mut self, t: &Tuple, flags: u8, obs: &Observed, side: Side) -> Result<(), Fail> {
        let starts = starts_flow(t.proto, flags);
        let reply = t.reverse();
        let owner = self.flow_owner(&reply);
        match obs {
            Observed::Untouched => {
                match owner {
                    Some(g) if self.flows[g].live() && starts => {
                        return fail(
                            if side == Side::Pod {
                                "direct flow clashing with a live translated flow not remapped"
                            } else {
                                "external direct flow clashing with a live translated flow not remapped"
                            },
                            format!(
                                "{t:?} [{}] went out untouched, but its replies {reply:?} belong to live flow {}: \
                                 they will be un-NATed for that flow and this one never gets an answer (or that \
                                 one loses its replies)",
                                flags_name(flags),
                                self.flows[g].describe()
                            ),
                        );
                    }
                    Some(g) if self.flows[g].live() => {}
                    Some(g) if starts => {
                        self.remove_flow(g);
                        self.owners.insert(reply, Owner::Direct);
                    }
                    Some(g) => self.flows[g].maybe_yielded = true,
                    None => {
                        self.owners.entry(reply).or_insert(Owner::Direct);
                    }
                }
                Ok(())
            }
            Observed::Changed { verdict, fields, .. } => {
                let Some((sport, dport)) = fields.ports else { unreachable!() };
                if fields.src != t.src
                    || fields.dst != t.dst
                    || dport != t.dport
                    || !in_snat_range(sport)
                    || *verdict != Verdict::Pass
                {
                    return fail(
                        "direct packet changed beyond a source-port remap",
                        format!("{t:?} [{}] (to no Service) was {obs}", flags_name(flags)),
                    );
                }
                if owner.is_none() {
                    return fail(
                        "source port remapped without a clash",
                        format!(
                            "{t:?} [{}] (to no Service) was {obs}, but no flow has its reply tuple",
                            flags_name(flags)
                        ),
                    );
                }
                let wire = Tuple { sport, ..*t };
                if let Some(h) = self.flow_owner(&wire.reverse()) {
                    return fail(
                        "translated source port already in use",
                        format!(
                            "{t:?} was remapped to {wire:?}, whose replies belong to {}",
                            self.flows[h].describe()
                        ),
                    );
                }
                let mut flow = self.new_flow(*t, wire, None);
                flow.remapped = true;
                self.add_flow(flow);
                Ok(())
            }
            Observed::Dropped if (t.proto == TCP && !tcp_valid(flags)) || (owner.is_some() && !starts) => {
                Ok(())
            }
            _ => fail(
                "direct packet dropped or answered",
                format!("{t:?} [{}] (to no Service) was {obs}", flags_name(flags)),
            ),
        }
    }

    fn egress(&mut self, t: &Tuple, flags: u8, obs: &Observed) -> Result<(), Fail> {
        match self.flow_owner(t) {
            Some(id) => {
                let f = self.flows[id].clone();
                let expected = Fields::of_tuple(&f.orig.reverse());
                match obs {
                    Observed::Changed { verdict: Verdict::Pass, fields, .. } if *fields == expected => {
                        self.flows[id].maybe_yielded = false;
                        Ok(())
                    }
                    Observed::Untouched if f.maybe_yielded => {
                        self.remove_flow(id);
                        self.owners.insert(*t, Owner::Direct);
                        Ok(())
                    }
                    Observed::Dropped if t.proto == TCP && !tcp_valid(flags) => Ok(()),
                    _ => fail(
                        "reply of a translated flow not un-NATed",
                        format!(
                            "{t:?} [{}] is a reply of {}: it should have become {expected}, but was {obs}",
                            flags_name(flags),
                            f.describe()
                        ),
                    ),
                }
            }
            None => match obs {
                Observed::Untouched => Ok(()),
                _ => fail(
                    "packet of no translated flow changed on its way in",
                    format!(
                        "{t:?} [{}] belongs to no translated flow{}, but was {obs}",
                        flags_name(flags),
                        self.history_of(t)
                    ),
                ),
            },
        }
    }

    fn snat_reply(&mut self, id: usize, flags: u8, obs: &Observed) -> Result<(), Fail> {
        let f = self.flows[id].clone();
        let expected = Fields::of_tuple(&f.orig.reverse());
        match obs {
            Observed::Changed { verdict: Verdict::Redirect, fields, .. } if *fields == expected => {
                self.flows[id].maybe_yielded = false;
                Ok(())
            }
            Observed::Untouched if f.maybe_yielded => {
                self.remove_flow(id);
                Ok(())
            }
            Observed::Dropped if f.orig.proto == TCP && !tcp_valid(flags) => Ok(()),
            _ => fail(
                "reply of a source-NATed flow not un-NATed",
                format!(
                    "the reply of {} should have become {expected} (redirected), but was {obs}",
                    f.describe()
                ),
            ),
        }
    }

    fn hairpin_reply(&mut self, t: &Tuple, flags: u8, obs: &Observed) -> Result<(), Fail> {
        match self.flow_owner(t) {
            Some(id) if self.flows[id].hairpin => {
                let f = self.flows[id].clone();
                let expected = Fields::of_tuple(&f.orig.reverse());
                match obs {
                    Observed::Changed { verdict: Verdict::Redirect, fields, bounce: true }
                        if *fields == expected =>
                    {
                        Ok(())
                    }
                    Observed::Untouched if f.maybe_yielded => Ok(()),
                    Observed::Dropped if t.proto == TCP && !tcp_valid(flags) => Ok(()),
                    _ => fail(
                        "reply of a hairpin flow not un-NATed",
                        format!(
                            "{t:?} is a reply of {}: it should have become {expected}, but was {obs}",
                            f.describe()
                        ),
                    ),
                }
            }
            _ => match obs {
                Observed::Untouched | Observed::Dropped => Ok(()),
                _ => fail(
                    "packet of no translated flow changed on its way in",
                    format!("{t:?} to the hairpin address belongs to no hairpin flow, but was {obs}"),
                ),
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn later_fragment(
        &mut self,
        hop: Hop,
        src: [u8; 4],
        dst: [u8; 4],
        proto: u8,
        id: u16,
        input: Fields,
        obs: &Observed,
    ) -> Result<(), Fail> {
        let Some(&(sport, dport)) = self.fragment_ports.get(&(src, dst, id, proto)) else {
            return untouched(obs, "later fragment of an unknown datagram changed");
        };
        let t = Tuple::new(src, sport, dst, dport, proto);
        let addrs = |t: &Tuple| Fields { src: t.src, dst: t.dst, ports: None, quote: None };
        let to_frontend = self.config.frontend(dst, dport, proto).is_some() || self.config.is_cluster_ip(dst);
        // (expected fields, verdict, bounce, flow it follows, other outcomes allowed)
        let mut expect: Option<(Fields, Verdict, bool, usize)> = None;
        let mut may_pass = false;
        let mut may_drop = proto == TCP && to_frontend;
        let owner = self.flow_owner(&t);
        let forward = self.by_orig.get(&t).copied();
        match hop {
            Hop::PodIngress if dst == HAIRPIN => {
                if let Some(f) = owner.filter(|&f| self.flows[f].hairpin) {
                    expect = Some((addrs(&self.flows[f].orig.reverse()), Verdict::Redirect, true, f));
                } else {
                    may_pass = true;
                    may_drop = true;
                }
            }
            Hop::PodIngress | Hop::ExternalTc | Hop::ExternalXdp
                if owner.is_some_and(|f| self.flows[f].snat) =>
            {
                let f = owner.unwrap();
                expect = Some((addrs(&self.flows[f].orig.reverse()), Verdict::Redirect, false, f));
            }
            Hop::ExternalTc | Hop::ExternalXdp if owner.is_some() => may_pass = true,
            Hop::PodIngress | Hop::ExternalTc | Hop::ExternalXdp => match forward {
                Some(f) => {
                    let flow = &self.flows[f];
                    let verdict = if flow.hairpin || flow.snat { Verdict::Redirect } else { Verdict::Pass };
                    expect = Some((addrs(&flow.wire), verdict, flow.hairpin, f));
                    let udp_backend_gone = proto == UDP
                        && flow.service.is_some()
                        && (flow.backend_lost
                            || !self.config.backend_current(flow.wire.dst, flow.wire.dport, UDP));
                    if udp_backend_gone || flow.maybe_yielded {
                        may_pass = true;
                    }
                }
                None => may_pass = true,
            },
            Hop::PodEgress | Hop::ExternalEgress => match owner {
                Some(f) if !self.flows[f].snat && !self.flows[f].hairpin => {
                    expect = Some((addrs(&self.flows[f].orig.reverse()), Verdict::Pass, false, f));
                    may_pass = self.flows[f].maybe_yielded;
                }
                _ => may_pass = true,
            },
        }
        if hop == Hop::ExternalXdp {
            may_pass = true;
        }
        if let Some((fields, verdict, bounce, _)) = expect {
            let matches = match obs {
                Observed::Changed { verdict: v, fields: f, bounce: b } => {
                    *f == fields && *v == verdict && (*b || !bounce)
                }
                Observed::Untouched => fields == input && verdict == Verdict::Pass,
                _ => false,
            };
            if matches {
                return Ok(());
            }
        }
        match obs {
            Observed::Untouched if may_pass => {
                // A UDP flow whose backend is gone may end on any packet, its later fragments
                // too (it would move to another backend on its next datagram).
                if let (Some(f), true) = (forward, matches!(hop, Hop::PodIngress | Hop::ExternalTc))
                    && self.flows[f].alive
                    && proto == UDP
                    && self.flows[f].service.is_some()
                    && !self.config.backend_current(self.flows[f].wire.dst, self.flows[f].wire.dport, UDP)
                {
                    self.remove_flow(f);
                }
                Ok(())
            }
            Observed::Dropped if may_drop => Ok(()),
            _ => {
                let want = match expect {
                    Some((fields, verdict, _, f)) => {
                        format!("{fields} ({verdict:?}) as {}", self.flows[f].describe())
                    }
                    None => "untouched".into(),
                };
                fail(
                    "later fragment not translated as its datagram",
                    format!(
                        "a later fragment of {t:?} (ports from its first fragment) should have been {want}, but was {obs}"
                    ),
                )
            }
        }
    }

    fn icmp_error(
        &mut self,
        hop: Hop,
        outer_src: [u8; 4],
        outer_dst: [u8; 4],
        quote: &Tuple,
        quote_has_options: bool,
        obs: &Observed,
    ) -> Result<(), Fail> {
        let owner = self.flow_owner(&quote.reverse());
        let describe = |o: &Oracle| {
            format!(
                "ICMP error {} → {} quoting [{quote:?}]{}",
                super::frame::ip(outer_src),
                super::frame::ip(outer_dst),
                match owner {
                    Some(f) => format!(" (a packet of {})", o.flows[f].describe()),
                    None => " (no translated flow)".into(),
                }
            )
        };
        match hop {
            Hop::PodIngress => untouched(obs, "ICMP error changed on its way out of a pod"),
            Hop::PodEgress | Hop::ExternalEgress => match owner {
                Some(f) if !self.flows[f].snat && !self.flows[f].hairpin => {
                    let flow = &self.flows[f];
                    let expected = Fields {
                        src: if outer_src == quote.dst { flow.orig.dst } else { outer_src },
                        dst: outer_dst,
                        ports: None,
                        quote: Some(flow.orig),
                    };
                    let to_client = outer_dst == quote.src;
                    match obs {
                        Observed::Changed { verdict: Verdict::Pass, fields, .. } if *fields == expected => {
                            Ok(())
                        }
                        Observed::Untouched if !to_client || quote_has_options || flow.maybe_yielded => {
                            Ok(())
                        }
                        _ => fail(
                            "ICMP error about a translated flow not un-NATed for its client",
                            format!("{} should have become {expected}, but was {obs}", describe(self)),
                        ),
                    }
                }
                _ => match obs {
                    Observed::Untouched => Ok(()),
                    _ => fail(
                        "ICMP error about no translated flow changed",
                        format!("{} was {obs}", describe(self)),
                    ),
                },
            },
            Hop::ExternalTc | Hop::ExternalXdp => match owner {
                Some(f) if self.flows[f].snat && outer_dst == quote.src => {
                    let flow = &self.flows[f];
                    let expected = Fields {
                        src: if outer_src == quote.dst { flow.orig.dst } else { outer_src },
                        dst: flow.orig.src,
                        ports: None,
                        quote: Some(flow.orig),
                    };
                    match obs {
                        Observed::Changed { verdict: Verdict::Redirect, fields, .. }
                            if *fields == expected =>
                        {
                            Ok(())
                        }
                        Observed::Untouched
                            if hop == Hop::ExternalXdp || quote_has_options || flow.maybe_yielded =>
                        {
                            Ok(())
                        }
                        _ => fail(
                            "ICMP error about a source-NATed flow not un-NATed for its client",
                            format!(
                                "{} should have become {expected} (redirected), but was {obs}",
                                describe(self)
                            ),
                        ),
                    }
                }
                _ => match obs {
                    Observed::Untouched => Ok(()),
                    _ => fail(
                        "ICMP error changed on the external interface",
                        format!(
                            "{} was {obs}, but it is not addressed to the node about a source-NATed flow",
                            describe(self)
                        ),
                    ),
                },
            },
        }
    }

    /// For messages: what the model knows of a tuple's past.
    fn history_of(&self, t: &Tuple) -> String {
        let related: Vec<String> = self
            .flows
            .iter()
            .rev()
            .filter(|f| f.reply() == *t || f.orig.reverse() == *t)
            .take(3)
            .map(|f| format!("{}{}", f.describe(), if f.alive { "" } else { " (ended)" }))
            .collect();
        if related.is_empty() { String::new() } else { format!(" (earlier: {})", related.join("; ")) }
    }
}

fn forward_verdict_ok(f: &Flow, verdict: Verdict, bounce: bool) -> bool {
    if f.hairpin {
        verdict == Verdict::Redirect && bounce
    } else if f.snat {
        verdict == Verdict::Redirect
    } else {
        verdict == Verdict::Pass
    }
}

fn untouched(obs: &Observed, check: &'static str) -> Result<(), Fail> {
    match obs {
        Observed::Untouched => Ok(()),
        _ => fail(check, format!("it was {obs}")),
    }
}

/// A refusal of `t` (the packet `input`): a TCP RST by RFC 793's rules or an ICMP port unreachable
/// quoting the datagram, from the address it was sent to, back to its sender.
fn valid_refusal(t: &Tuple, input: &[u8], out: &[u8], bounce: bool) -> Result<(), Fail> {
    use super::frame::{bad_checksums, ipv4, kind};
    let bad =
        |why: String| fail("refusal malformed", format!("{t:?}: {why}; refusal {}", super::frame::hex(out)));
    if !bounce {
        return bad("not sent back to the sender's MAC address".into());
    }
    let checks = bad_checksums(out, None);
    if !checks.is_empty() {
        return bad(format!("bad checksums: {checks:?}"));
    }
    let h = ipv4(input).unwrap();
    let l4 = h.l4();
    if t.proto == TCP {
        let Kind::L4 { tuple, flags, .. } = kind(out) else { return bad("not a TCP segment".into()) };
        if tuple != t.reverse() || flags & RST == 0 || out.len() != 14 + 40 {
            return bad("not a bare RST from the destination back to the source".into());
        }
        let word = |f: &[u8], at: usize| u32::from_be_bytes(f[at..at + 4].try_into().unwrap());
        let (seq, ack) = (word(input, l4 + 4), word(input, l4 + 8));
        let in_flags = input[l4 + 13];
        let data = h.total_len - h.header_len - usize::from(input[l4 + 12] >> 4) * 4;
        let (out_seq, out_ack) = (word(out, 34 + 4), word(out, 34 + 8));
        let ok = if in_flags & ACK != 0 {
            out_seq == ack && flags & ACK == 0
        } else {
            let len = data as u32 + u32::from(in_flags & SYN != 0) + u32::from(in_flags & FIN != 0);
            out_seq == 0 && flags & ACK != 0 && out_ack == seq.wrapping_add(len)
        };
        if !ok {
            return bad(format!(
                "sequence numbers seq {out_seq:#x} ack {out_ack:#x} break RFC 793's reset rules"
            ));
        }
    } else {
        let Some(o) = ipv4(out) else { return bad("not IPv4".into()) };
        let m = o.l4();
        if o.proto != super::frame::ICMP || out[m] != 3 || out[m + 1] != 3 || o.src != t.dst || o.dst != t.src
        {
            return bad("not an ICMP port unreachable from the destination back to the source".into());
        }
        if out[m + 8..o.end()] != input[14..(14 + h.header_len + 8).min(h.end())] {
            return bad("the quote is not the datagram's header and first 8 bytes".into());
        }
    }
    Ok(())
}
