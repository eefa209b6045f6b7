//! Differential test: every scenario below runs through kproxy and through kube-proxy's own rules
//! (iptables mode, nftables mode), each in its own one-node sandbox built the same way, and what
//! the client observed at each step is compared. kube-proxy is the oracle: every difference is a
//! defect of kproxy unless the scenario carries an `allow(step, oracle, field, why)` entry saying
//! why kproxy is right (or why the oracle's answer is an artefact of the sandbox); only that field
//! of that step may then differ. The harness — sandbox, servers, client, rule generators, how
//! observations are made comparable — is `sandbox::differential` (tests/src/differential/).
//!
//! Adding a scenario: append a `Scenario::new(name, about)` with its steps to [`scenarios`].
//! Steps open named sockets (`tcp`, `udp`, `udp_connected`, `tcp_from`/`udp_from` for the node or
//! another pod), talk (`hello`, `echo`, `dns`, `tcp_dns`), close (`server_close`,
//! `client_close`, `server_reset`, `client_reset`) and change the cluster (`change`);
//! destinations are `svc(name, port)`, `server_of(step)` (the pod that answered that step),
//! `pod(name, port)`; source ports are `Port::Nth(n)` (the same `n` is the same port: reuse) or
//! `Port::Any`. Use `.any_backend()` on a step whose answer is a fresh random pick among several
//! backends, so that only "one of the Service's endpoints" is compared.
//!
//! Run it: `cargo xtask test -p kproxy-tests --test differential -- --nocapture` (root; the three
//! modes run in parallel, in about a minute).

use std::time::Instant;

use sandbox::differential::{
    Change, Dst, Field, Mode, NODE_PORT, Oracle, Place, PodRef, Port, Scenario, StepResult, TERMINATING,
    UNALLOCATED_IP, UNREADY, World, lb, node_port, pod, server_of, svc,
};

const P0: Port = Port::Nth(0);
const P1: Port = Port::Nth(1);
const P2: Port = Port::Nth(2);

/// Why iptables mode answers differently for packets to a ClusterIP that no rule translates.
const IPTABLES_LEAKS_UNKNOWN_PORTS: &str = "kube-proxy's iptables mode has no rule for a port a \
    ClusterIP does not have: the packet is routed on untranslated (here to the sandbox's dead-end \
    route, as in a cluster to the default gateway) and the client times out; the nftables mode \
    (cluster-ips-check) and kproxy refuse it at once, which is what the Service API asks for";

/// Why kproxy's NodePort and load-balancer backends see the pod's own address where kube-proxy's
/// see the node's.
const LOCAL_BACKEND_NOT_MASQUERADED: &str = "kube-proxy masquerades all NodePort and load-balancer traffic \
    (externalTrafficPolicy: Cluster) so that a remote backend's replies come back through this node; \
    kproxy source-NATs only flows whose backend is elsewhere (docs/architecture.md: local backends \
    are not SNATed, as Cilium does) — the replies of a local backend pass the node anyway, so the \
    client observes the same connection and answers, and the backend sees the real client";

fn remove(service: &'static str, step: usize) -> Change {
    Change::RemoveEndpoint { service, pod: PodRef::ServerOf(step) }
}

/// An established connection through `web` meets `change` to its backend: it goes on, and a new
/// connection works.
fn backend_change_mid_stream(name: &'static str, about: &'static str, change: Change) -> Scenario {
    Scenario::new(name, about)
        .tcp("a", svc("web", 80), P0)
        .hello("a")
        .change(change)
        .hello("a")
        .tcp("b", svc("web", 80), P1)
        .hello("b")
        .any_backend()
        .client_close("a")
}

fn scenarios() -> Vec<Scenario> {
    let mut list = vec![
        Scenario::new("clusterip-tcp", "a TCP connection to a ClusterIP reaches a backend")
            .tcp("a", svc("web", 80), P0)
            .hello("a")
            .any_backend()
            .client_close("a"),
        Scenario::new("clusterip-dns-udp", "a DNS query to the cluster DNS ClusterIP is answered from it")
            .udp("u", P0)
            .dns("u", svc("kube-dns", 53))
            .any_backend(),
        Scenario::new("clusterip-dns-tcp", "a DNS query over TCP to the cluster DNS ClusterIP")
            .tcp("a", svc("kube-dns", 53), P0)
            .tcp_dns("a")
            .any_backend()
            .client_close("a"),
        Scenario::new("clusterip-udp-connected", "a connected UDP socket to a ClusterIP gets its answers")
            .udp_connected("u", P0, svc("web", 80))
            .echo_connected("u", 100)
            .any_backend()
            .echo_connected("u", 100)
            .any_backend(),
        Scenario::new("udp-2000-byte-payload", "a 2000-byte datagram and its 2000-byte answer, in fragments")
            .udp("u", P0)
            .echo("u", svc("web", 80), 2000)
            .any_backend()
            .echo("u", svc("one", 80), 2000),
        Scenario::new("port-the-service-does-not-have", "TCP and UDP to a port the ClusterIP does not serve")
            .tcp("a", svc("web", 81), P0)
            .udp_connected("u", P1, svc("web", 81))
            .echo_connected("u", 100)
            .allow(0, Oracle::Iptables, Field::Outcome, IPTABLES_LEAKS_UNKNOWN_PORTS)
            .allow(2, Oracle::Iptables, Field::Outcome, IPTABLES_LEAKS_UNKNOWN_PORTS),
        Scenario::new("service-without-endpoints", "a Service with no endpoints refuses at once, TCP and UDP")
            .tcp("a", svc("empty", 80), P0)
            .udp_connected("u", P1, svc("empty", 80))
            .echo_connected("u", 100),
        Scenario::new("unallocated-cluster-ip", "an address of the ServiceCIDR that no Service has")
            .tcp("a", Dst::Addr(UNALLOCATED_IP, 80), P0),
        Scenario::new(
            "backend-without-listener",
            "the backend refuses (RST, ICMP port unreachable): the client hears it from the ClusterIP",
        )
        .tcp("a", svc("deaf", 80), P0)
        .udp_connected("u", P1, svc("deaf", 80))
        .echo_connected("u", 100),
        // The port-reuse cases of issue 13.
        Scenario::new(
            "tcp-reuse-after-server-close",
            "ClusterIP connection from port P lands on B, the server closes first (no TIME_WAIT on the \
             client), then P connects straight to B's pod IP",
        )
        .tcp("a", svc("web", 80), P0)
        .hello("a")
        .server_close("a")
        .tcp("b", server_of(1), P0)
        .hello("b")
        .server_close("b"),
        Scenario::new(
            "tcp-reuse-after-client-close",
            "as above, but the client closes first (it holds TIME_WAIT towards the ClusterIP)",
        )
        .tcp("a", svc("web", 80), P0)
        .hello("a")
        .client_close("a")
        .tcp("b", server_of(1), P0)
        .hello("b")
        .client_close("b"),
        Scenario::new("tcp-reuse-after-client-reset", "as above, but the client aborts (RST)")
            .tcp("a", svc("web", 80), P0)
            .hello("a")
            .client_reset("a")
            .tcp("b", server_of(1), P0)
            .hello("b")
            .client_close("b"),
        Scenario::new("tcp-reuse-after-server-reset", "as above, but the server aborts (RST)")
            .tcp("a", svc("web", 80), P0)
            .hello("a")
            .server_reset("a")
            .tcp("b", server_of(1), P0)
            .hello("b")
            .client_close("b"),
        Scenario::new(
            "tcp-reconnect-after-reset",
            "the client aborts a ClusterIP connection and reconnects from the same port to the same ClusterIP",
        )
        .tcp("a", svc("one", 80), P0)
        .hello("a")
        .client_reset("a")
        .tcp("b", svc("one", 80), P0)
        .hello("b")
        .client_close("b"),
        Scenario::new(
            "tcp-direct-then-clusterip",
            "port P talks to B's pod IP first (server closes), then connects to a ClusterIP whose only backend is B",
        )
        .tcp("a", pod("web-1", 8080), P0)
        .hello("a")
        .server_close("a")
        .tcp("b", svc("one", 80), P0)
        .hello("b")
        .client_close("b"),
        Scenario::new(
            "tcp-live-collision",
            "a live connection P→ClusterIP (→B) and, at the same time, a second socket on P straight to B",
        )
        .tcp("a", svc("web", 80), P0)
        .hello("a")
        .tcp("b", server_of(1), P0)
        .hello("b")
        .hello("a")
        .hello("b")
        .client_close("a")
        .client_close("b"),
        Scenario::new(
            "two-services-one-backend-tcp",
            "the same client port to two Services whose only backend is the same pod, concurrently",
        )
        .tcp("a", svc("one", 80), P0)
        .tcp("b", svc("one-again", 80), P0)
        .hello("a")
        .hello("b")
        .hello("a")
        .client_close("a")
        .client_close("b"),
        Scenario::new(
            "two-services-one-backend-udp",
            "one UDP socket to two Services whose only backend is the same pod, alternately",
        )
        .udp("u", P0)
        .echo("u", svc("one", 80), 100)
        .echo("u", svc("one-again", 80), 100)
        .echo("u", svc("one", 80), 100)
        .echo("u", svc("one-again", 80), 100),
        Scenario::new(
            "udp-dns-reuse-direct-after-clusterip",
            "a DNS query from P to the ClusterIP, answered; then from P straight to that DNS pod; then the ClusterIP again",
        )
        .udp("u", P0)
        .dns("u", svc("kube-dns", 53))
        .dns("u", server_of(1))
        .dns("u", svc("kube-dns", 53)),
        Scenario::new(
            "udp-live-collision",
            "one unconnected UDP socket alternating between a ClusterIP and its backend's pod IP",
        )
        .udp("u", P0)
        .echo("u", svc("one", 80), 100)
        .echo("u", pod("web-1", 8080), 100)
        .echo("u", svc("one", 80), 100)
        .echo("u", pod("web-1", 8080), 100),
        Scenario::new(
            "udp-direct-then-clusterip",
            "a DNS query from P to a DNS pod first, then to the ClusterIP, then to the pod again",
        )
        .udp("u", P0)
        .dns("u", pod("coredns-1", 53))
        .dns("u", svc("kube-dns", 53))
        .any_backend()
        .dns("u", pod("coredns-1", 53)),
        // Backend changes.
        backend_change_mid_stream(
            "tcp-endpoint-removed-mid-stream",
            "the backend of an established connection leaves the EndpointSlice while its pod still serves",
            remove("web", 1),
        ),
        backend_change_mid_stream(
            "tcp-endpoint-unready-mid-stream",
            "the backend of an established connection becomes unready (readiness flap)",
            Change::Conditions { service: "web", pod: PodRef::ServerOf(1), conditions: UNREADY },
        ),
        backend_change_mid_stream(
            "tcp-endpoint-terminating-mid-stream",
            "the backend of an established connection starts terminating (still serving)",
            Change::Conditions { service: "web", pod: PodRef::ServerOf(1), conditions: TERMINATING },
        ),
        Scenario::new(
            "tcp-last-endpoint-removed-mid-stream",
            "a Service loses its only endpoint: the established connection goes on, new ones are refused",
        )
        .tcp("a", svc("one", 80), P0)
        .hello("a")
        .change(remove("one", 1))
        .hello("a")
        .tcp("b", svc("one", 80), P1)
        .client_close("a"),
        Scenario::new(
            "tcp-service-deleted-mid-stream",
            "the Service of an established connection is deleted: the connection goes on",
        )
        .tcp("a", svc("one-again", 80), P0)
        .hello("a")
        .change(Change::DeleteService("one-again"))
        .hello("a")
        .hello("a")
        .tcp("b", svc("one-again", 80), P1)
        .client_close("a"),
        Scenario::new(
            "udp-backend-removed-same-port",
            "a DNS client keeps its source port while its DNS pod leaves the Service: the next query reaches the other one",
        )
        .udp("u", P0)
        .dns("u", svc("kube-dns", 53))
        .change(remove("kube-dns", 1))
        .dns("u", svc("kube-dns", 53))
        .dns("u", svc("kube-dns", 53)),
        Scenario::new(
            "udp-backend-unready-same-port",
            "as above, but the DNS pod becomes unready instead of leaving",
        )
        .udp("u", P0)
        .dns("u", svc("kube-dns", 53))
        .change(Change::Conditions { service: "kube-dns", pod: PodRef::ServerOf(1), conditions: UNREADY })
        .dns("u", svc("kube-dns", 53)),
        Scenario::new(
            "endpoints-appear",
            "a Service without endpoints gets one: the same UDP socket and a new connection reach it",
        )
        .udp_connected("u", P0, svc("empty", 80))
        .echo_connected("u", 100)
        .change(Change::AddEndpoint { service: "empty", pod: PodRef::Named("web-2") })
        .echo_connected("u", 100)
        .tcp("a", svc("empty", 80), P1)
        .hello("a")
        .client_close("a"),
        Scenario::new(
            "udp-backend-terminating-same-port",
            "a DNS client keeps its source port while its DNS pod terminates but still serves: it stays there",
        )
        .udp("u", P0)
        .dns("u", svc("kube-dns", 53))
        .change(Change::Conditions { service: "kube-dns", pod: PodRef::ServerOf(1), conditions: TERMINATING })
        .dns("u", svc("kube-dns", 53)),
        Scenario::new(
            "udp-service-deleted-mid-flow",
            "the Service of a UDP flow is deleted: the flow's next datagram still reaches its backend",
        )
        .udp("u", P0)
        .echo("u", svc("one-again", 80), 100)
        .change(Change::DeleteService("one-again"))
        .echo("u", svc("one-again", 80), 100),
        Scenario::new("udp-same-port-sticks", "five DNS queries from one port all reach the same DNS pod")
            .udp("u", P0)
            .dns("u", svc("kube-dns", 53))
            .dns("u", svc("kube-dns", 53))
            .dns("u", svc("kube-dns", 53))
            .dns("u", svc("kube-dns", 53))
            .dns("u", svc("kube-dns", 53)),
        Scenario::new(
            "tcp-endpoint-added-mid-stream",
            "a Service gains an endpoint: its established connection stays, new ones may use either",
        )
        .tcp("a", svc("one", 80), P0)
        .hello("a")
        .change(Change::AddEndpoint { service: "one", pod: PodRef::Named("web-2") })
        .hello("a")
        .tcp("b", svc("one", 80), P1)
        .hello("b")
        .any_backend()
        .client_close("a"),
        Scenario::new("hairpin", "a pod reaches itself through a Service whose only backend it is")
            .tcp_from(Place::Pod("web-1"), "a", svc("one", 80), P0)
            .hello("a")
            .udp_from(Place::Pod("web-1"), "u", P1)
            .echo("u", svc("one", 80), 100)
            .client_close("a"),
        Scenario::new(
            "hairpin-port-reuse",
            "a pod reaches itself through its Service from port P, the server closes first, then P again",
        )
        .tcp_from(Place::Pod("web-1"), "a", svc("one", 80), P0)
        .hello("a")
        .server_close("a")
        .tcp_from(Place::Pod("web-1"), "b", svc("one", 80), P0)
        .hello("b")
        .server_close("b"),
        // NodePorts (externalTrafficPolicy: Cluster) reached from inside the cluster.
        Scenario::new("nodeport-from-pod", "a pod reaches a NodePort on the node's address, TCP and UDP")
            .tcp("a", node_port(NODE_PORT), P0)
            .hello("a")
            .udp("u", P1)
            .echo("u", node_port(NODE_PORT), 100)
            .client_close("a")
            .allow(1, Oracle::Both, Field::Seen, LOCAL_BACKEND_NOT_MASQUERADED)
            .allow(3, Oracle::Both, Field::Seen, LOCAL_BACKEND_NOT_MASQUERADED),
        Scenario::new(
            "nodeport-reuse-after-server-close",
            "a NodePort connection from port P lands on B, the server closes first, then P connects straight to B",
        )
        .tcp("a", node_port(NODE_PORT), P0)
        .hello("a")
        .server_close("a")
        .tcp("b", server_of(1), P0)
        .hello("b")
        .server_close("b")
        .allow(1, Oracle::Both, Field::Seen, LOCAL_BACKEND_NOT_MASQUERADED),
        Scenario::new(
            "nodeport-udp-live-collision",
            "one UDP socket alternating between a NodePort and its backend's pod IP",
        )
        .udp("u", P0)
        .echo("u", node_port(NODE_PORT), 100)
        .echo("u", server_of(1), 100)
        .echo("u", node_port(NODE_PORT), 100)
        .allow(1, Oracle::Both, Field::Seen, LOCAL_BACKEND_NOT_MASQUERADED)
        .allow(3, Oracle::Both, Field::Seen, LOCAL_BACKEND_NOT_MASQUERADED),
        Scenario::new(
            "nodeport-tcp-live-collision",
            "a live NodePort connection from P and, at the same time, a second socket on P straight to its backend",
        )
        .tcp("a", node_port(NODE_PORT), P0)
        .hello("a")
        .tcp("b", server_of(1), P0)
        .hello("b")
        .hello("a")
        .client_close("a")
        .client_close("b")
        .allow(1, Oracle::Both, Field::Seen, LOCAL_BACKEND_NOT_MASQUERADED)
        .allow(4, Oracle::Both, Field::Seen, LOCAL_BACKEND_NOT_MASQUERADED),
        Scenario::new("loadbalancer-from-pod", "a pod reaches a LoadBalancer Service's IP, TCP and UDP")
            .tcp("a", lb("lb", 80), P0)
            .hello("a")
            .udp("u", P1)
            .echo("u", lb("lb", 80), 100)
            .client_close("a")
            .allow(1, Oracle::Both, Field::Seen, LOCAL_BACKEND_NOT_MASQUERADED)
            .allow(3, Oracle::Both, Field::Seen, LOCAL_BACKEND_NOT_MASQUERADED),
        Scenario::new(
            "loadbalancer-source-ranges",
            "loadBalancerSourceRanges hold for pods and the node: only web-2 reaches the load-balancer IP; its NodePort stays open",
        )
        .tcp("a", lb("lb-ranged", 80), P0)
        .udp("u", P1)
        .echo("u", lb("lb-ranged", 80), 100)
        .tcp_from(Place::Pod("web-2"), "b", lb("lb-ranged", 80), P2)
        .hello("b")
        .tcp_from(Place::Node, "n", lb("lb-ranged", 80), Port::Nth(3))
        .tcp("c", node_port(30083), Port::Nth(4))
        .hello("c")
        .client_close("b")
        .client_close("c")
        .allow(4, Oracle::Both, Field::Seen, LOCAL_BACKEND_NOT_MASQUERADED)
        .allow(7, Oracle::Both, Field::Seen, LOCAL_BACKEND_NOT_MASQUERADED),
        Scenario::new(
            "internal-traffic-policy-local-elsewhere",
            "internalTrafficPolicy: Local with every endpoint on other nodes: TCP and UDP are dropped (timeout), not refused",
        )
        .tcp("a", svc("local-elsewhere", 80), P0)
        .udp_connected("u", P1, svc("local-elsewhere", 80))
        .echo_connected("u", 100),
        Scenario::new(
            "prefer-same-node-hints",
            "trafficDistribution: PreferSameNode with node hints: every connection and datagram reaches this node's endpoint",
        )
        .tcp("a", svc("same-node", 80), P0)
        .hello("a")
        .tcp("b", svc("same-node", 80), P1)
        .hello("b")
        .tcp("c", svc("same-node", 80), P2)
        .hello("c")
        .udp("u", Port::Nth(3))
        .echo("u", svc("same-node", 80), 100)
        .tcp("d", pod("web-1", 8080), Port::Nth(4))
        .hello("d")
        .client_close("a")
        .client_close("b")
        .client_close("c")
        .client_close("d"),
        Scenario::new("nodeport-from-node", "a process of the node reaches a NodePort on the node's own address")
            .tcp_from(Place::Node, "a", node_port(NODE_PORT), P0)
            .hello("a")
            .client_close("a"),
        Scenario::new(
            "node-client-refusals",
            "the node's own process to a Service without endpoints and to a port a ClusterIP does not have",
        )
        .tcp_from(Place::Node, "a", svc("empty", 80), P0)
        .tcp_from(Place::Node, "b", svc("web", 81), P1)
        .allow(1, Oracle::Iptables, Field::Outcome, IPTABLES_LEAKS_UNKNOWN_PORTS),
        Scenario::new(
            "node-client-port-reuse",
            "the node's own process: ClusterIP from port P, the server closes first, then P straight to the backend",
        )
        .tcp_from(Place::Node, "a", svc("web", 80), P0)
        .hello("a")
        .server_close("a")
        .tcp_from(Place::Node, "b", server_of(1), P0)
        .hello("b")
        .server_close("b"),
        Scenario::new(
            "node-udp-live-collision",
            "the node's own UDP socket asks the DNS ClusterIP, then that DNS pod directly, then the ClusterIP again",
        )
        .udp_from(Place::Node, "u", P0)
        .dns("u", svc("kube-dns", 53))
        .dns("u", server_of(1))
        .dns("u", svc("kube-dns", 53)),
        Scenario::new("node-client", "a process of the node itself (hostNetwork) uses ClusterIPs")
            .tcp_from(Place::Node, "a", svc("web", 80), P0)
            .hello("a")
            .any_backend()
            .udp_from(Place::Node, "u", P1)
            .dns("u", svc("kube-dns", 53))
            .any_backend()
            .client_close("a"),
    ];

    let mut stream = Scenario::new(
        "long-stream",
        "twenty requests on one connection all reach the same backend",
    )
    .tcp("a", svc("web", 80), P0);
    for _ in 0..20 {
        stream = stream.hello("a");
    }
    list.push(stream.client_close("a"));

    let mut rounds = Scenario::new(
        "port-reuse-rounds",
        "five rounds on one port: ClusterIP, server closes, the backend's pod IP, server closes",
    );
    for _ in 0..5 {
        let hello = rounds.next_step() + 1;
        rounds = rounds
            .tcp("a", svc("one", 80), P2)
            .hello("a")
            .server_close("a")
            .tcp("b", server_of(hello), P2)
            .hello("b")
            .server_close("b");
    }
    list.push(rounds);

    let mut sticky_tcp = Scenario::new(
        "session-affinity-tcp",
        "sessionAffinity: ClientIP — five connections from five ports all reach the same backend",
    );
    let mut sticky_udp = Scenario::new(
        "session-affinity-udp",
        "sessionAffinity: ClientIP — datagrams from four ports all reach the same backend",
    );
    let mut sticky_node =
        Scenario::new("session-affinity-node", "sessionAffinity: ClientIP for the node's own connections");
    let sockets = ["s0", "s1", "s2", "s3", "s4"];
    for (n, sock) in sockets.iter().enumerate() {
        let port = Port::Nth(n as u16);
        sticky_tcp = sticky_tcp.tcp(sock, svc("sticky", 80), port).hello(sock).client_close(sock);
        sticky_node =
            sticky_node.tcp_from(Place::Node, sock, svc("sticky", 80), port).hello(sock).client_close(sock);
        if n < 4 {
            sticky_udp = sticky_udp.udp(sock, port).echo(sock, svc("sticky", 80), 100);
        }
    }
    list.extend([sticky_tcp, sticky_udp, sticky_node]);
    list.push(
        Scenario::new(
            "session-affinity-backend-removed",
            "sessionAffinity: ClientIP — the sticky backend leaves the Service: the next connection goes elsewhere",
        )
        .tcp("a", svc("sticky", 80), P0)
        .hello("a")
        .client_close("a")
        .change(remove("sticky", 1))
        .tcp("b", svc("sticky", 80), P1)
        .hello("b")
        .tcp("c", svc("sticky", 80), P2)
        .hello("c")
        .client_close("b")
        .client_close("c"),
    );

    let mut concurrent = Scenario::new("concurrent-connections", "eight connections at once to a ClusterIP");
    let names = ["c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7"];
    for (n, name) in names.iter().enumerate() {
        concurrent = concurrent.tcp(name, svc("web", 80), Port::Nth(n as u16));
    }
    for name in names {
        concurrent = concurrent.hello(name).any_backend();
    }
    for name in names {
        concurrent = concurrent.client_close(name);
    }
    list.push(concurrent);
    list
}

/// Runs every scenario in one mode's sandbox.
fn run_mode(mode: Mode, scenarios: &[Scenario]) -> anyhow::Result<Vec<Vec<StepResult>>> {
    let started = Instant::now();
    let mut world = World::start(mode)?;
    eprintln!("differential: {mode} sandbox ready after {:.1?}", started.elapsed());
    let mut all = Vec::new();
    for (i, scenario) in scenarios.iter().enumerate() {
        let started = Instant::now();
        all.push(world.run(i, scenario)?);
        eprintln!("differential: {mode}: {} ({:.1?})", scenario.name, started.elapsed());
    }
    Ok(all)
}

#[test]
fn kproxy_observes_what_kube_proxy_clients_observe() {
    let mut scenarios = scenarios();
    // DIFFERENTIAL_ONLY=name,name runs only those scenarios (while working on one).
    if let Ok(only) = std::env::var("DIFFERENTIAL_ONLY") {
        let wanted: Vec<&str> = only.split(',').map(str::trim).collect();
        scenarios.retain(|s| wanted.contains(&s.name));
        assert!(!scenarios.is_empty(), "DIFFERENTIAL_ONLY={only} names no scenario");
    }
    let mut names: Vec<&str> = scenarios.iter().map(|s| s.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), scenarios.len(), "scenario names must be unique");

    let modes = [Mode::Kproxy, Mode::Iptables, Mode::Nftables];
    let list = &scenarios;
    let runs: Vec<Vec<Vec<StepResult>>> = std::thread::scope(|scope| {
        let handles: Vec<_> =
            modes.iter().map(|&mode| (mode, scope.spawn(move || run_mode(mode, list)))).collect();
        handles
            .into_iter()
            .map(|(mode, handle)| match handle.join() {
                Ok(Ok(results)) => results,
                Ok(Err(err)) => panic!("the {mode} run failed: {err:#}"),
                Err(_) => panic!("the {mode} run panicked"),
            })
            .collect()
    });
    let [kproxy, iptables, nftables] = &runs[..] else { unreachable!("three modes") };

    let show_raw = std::env::var_os("DIFFERENTIAL_RAW").is_some();
    let mut report = String::new();
    let mut defects = Vec::new();
    let mut allowed = 0;
    for (s, scenario) in scenarios.iter().enumerate() {
        report.push_str(&format!("\n{} — {}\n", scenario.name, scenario.about));
        for (i, k) in kproxy[s].iter().enumerate() {
            let (ipt, nft) = (&iptables[s][i], &nftables[s][i]);
            report.push_str(&format!("  [{i}] {}\n", k.what));
            // DIFFERENTIAL_RAW=1 adds each client's own report (ports, addresses) to the log.
            let raw = |r: &StepResult| if show_raw { format!("    raw {}", r.raw) } else { String::new() };
            let mut lines = vec![format!("kproxy   {}{}", k.observation, raw(k))];
            let mut step_defects = Vec::new();
            for (oracle, name, result) in
                [(Oracle::Iptables, "iptables", ipt), (Oracle::Nftables, "nftables", nft)]
            {
                let explained = scenario
                    .allowances(i, oracle)
                    .any(|a| result.observation.without(a.field) == k.observation.without(a.field));
                let mark = if result.observation == k.observation {
                    ""
                } else if explained {
                    allowed += 1;
                    "  (differs: allowed)"
                } else {
                    step_defects.push(format!("{name}: {}", result.observation));
                    "  <-- DIFFERS"
                };
                lines.push(format!("{name:<8} {}{mark}{}", result.observation, raw(result)));
            }
            for line in &lines {
                report.push_str(&format!("        {line}\n"));
            }
            if !step_defects.is_empty() {
                defects.push(format!(
                    "{} step {i} ({}): kproxy: {} [raw {}]; {}",
                    scenario.name,
                    k.what,
                    k.observation,
                    k.raw,
                    step_defects.join("; ")
                ));
            }
            if ipt.observation != nft.observation {
                report.push_str("        (the two kube-proxy modes disagree)\n");
            }
        }
        for allowance in &scenario.allowed {
            report.push_str(&format!(
                "  allowed at step {} ({:?}, {:?} only): {}\n",
                allowance.step, allowance.oracle, allowance.field, allowance.why
            ));
        }
    }
    eprintln!("{report}");
    eprintln!(
        "differential: {} scenarios, {} steps, {} differences, {allowed} allowed",
        scenarios.len(),
        kproxy.iter().map(Vec::len).sum::<usize>(),
        defects.len()
    );
    assert!(
        defects.is_empty(),
        "kproxy's clients observed something else than kube-proxy's in {} steps:\n{}",
        defects.len(),
        defects.join("\n")
    );
}

/// The scenario list itself: names unique, every `server_of` and `allow` points at an earlier or
/// existing step, every socket is opened before it is used. Needs no root.
#[test]
fn scenarios_are_well_formed() {
    use sandbox::differential::Op;
    for scenario in scenarios() {
        let mut opened = std::collections::HashSet::new();
        for (i, step) in scenario.steps.iter().enumerate() {
            let refers = |dst: &Option<Dst>| {
                if let Some(Dst::ServerOf(k)) = dst {
                    assert!(*k < i, "{} step {i} refers to a later step", scenario.name);
                }
            };
            match &step.op {
                Op::TcpConnect { sock, dst, .. } => {
                    refers(&Some(*dst));
                    opened.insert(*sock);
                }
                Op::UdpOpen { sock, connect, .. } => {
                    refers(connect);
                    opened.insert(*sock);
                }
                Op::UdpEcho { to, .. } | Op::Dns { to, .. } => refers(to),
                _ => {}
            }
            if let Some(sock) = step.op.sock() {
                assert!(
                    opened.contains(sock),
                    "{} step {i} uses socket {sock} before opening it",
                    scenario.name
                );
            }
        }
    }
}
