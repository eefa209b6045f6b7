//! Dual-stack pieces the IPv6 sandbox tests share (dual_stack.rs, dual_stack_ops.rs, socket_lb6.rs):
//! the pods' IPv6 addresses, dual-stack pods, and EndpointSlice/Service manifests of both families.

use std::net::{Ipv4Addr, Ipv6Addr};

use sandbox::Pod;

use super::cluster::Cluster;

pub const WEB_VIP4: &str = "10.96.0.200";
pub const WEB_VIP6: &str = "fd00:10:96::200";
pub const DNS_VIP6: &str = "fd00:10:96::53";
pub const EMPTY_VIP4: &str = "10.96.0.50";
pub const EMPTY_VIP6: &str = "fd00:10:96::50";

/// Two dual-stack nginx pods and two dual-stack dnsmasq pods, beside the example cluster's.
pub const WEB_PODS6: [(&str, Ipv4Addr); 2] =
    [("web6-a", Ipv4Addr::new(10, 244, 0, 31)), ("web6-b", Ipv4Addr::new(10, 244, 0, 32))];
pub const DNS_PODS6: [(&str, Ipv4Addr); 2] =
    [("dns6-a", Ipv4Addr::new(10, 244, 0, 41)), ("dns6-b", Ipv4Addr::new(10, 244, 0, 42))];

pub const WEB_PORTS: &str = "- port: 80\n  protocol: TCP\n";
pub const DNS_PORTS: &str =
    "- name: dns\n  port: 53\n  protocol: UDP\n- name: dns-tcp\n  port: 53\n  protocol: TCP\n";

/// The pods' IPv6 addresses: `fd00:10:244::<last IPv4 octet>`.
pub fn ipv6_of(ip: Ipv4Addr) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, u16::from(ip.octets()[3]))
}

/// A pod of `cluster` with `ip` and [`ipv6_of`] it.
pub fn dual_pod(cluster: &Cluster, name: &str, ip: Ipv4Addr) -> Pod {
    let mut pod = cluster.sandbox.add_pod(name, ip).unwrap();
    pod.add_ipv6(ipv6_of(ip)).unwrap();
    pod
}

/// The `endpoints:` items of `pods`, by their IPv4 address or (`v6`) their [`ipv6_of`].
pub fn endpoints(pods: &[(&str, Ipv4Addr)], v6: bool) -> String {
    pods.iter()
        .map(|(name, ip)| {
            let addr = if v6 { format!("\"{}\"", ipv6_of(*ip)) } else { ip.to_string() };
            format!(
                "- addresses: [{addr}]\n  conditions: {{ready: true}}\n  nodeName: node-1\n  targetRef: {{kind: Pod, name: {name}}}\n"
            )
        })
        .collect()
}

/// An EndpointSlice `name` of Service `default/service` with `addressType: family`.
pub fn slice(name: &str, service: &str, family: &str, endpoints: String, ports: &str) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {service}\naddressType: {family}\nendpoints:\n{endpoints}ports:\n{ports}"
    )
}

/// `dual-web` (IPv4 and IPv6 cluster IPs, port 80 → 80, a slice per family, `web` behind it),
/// `dual-dns` (IPv6 only, 53 UDP and TCP, `dns` behind it) and `dual-empty` (dual-stack, no endpoints).
pub fn manifests(web: &[(&str, Ipv4Addr)], dns: &[(&str, Ipv4Addr)]) -> String {
    [
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: dual-web\n  namespace: default\nspec:\n  clusterIP: {WEB_VIP4}\n  clusterIPs: [{WEB_VIP4}, \"{WEB_VIP6}\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: RequireDualStack\n  ports:\n  - port: 80\n    protocol: TCP\n    targetPort: 80\n"
        ),
        slice("dual-web-v4", "dual-web", "IPv4", endpoints(web, false), WEB_PORTS),
        slice("dual-web-v6", "dual-web", "IPv6", endpoints(web, true), WEB_PORTS),
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: dual-dns\n  namespace: default\nspec:\n  clusterIP: \"{DNS_VIP6}\"\n  clusterIPs: [\"{DNS_VIP6}\"]\n  ipFamilies: [IPv6]\n  ipFamilyPolicy: SingleStack\n  ports:\n  - name: dns\n    port: 53\n    protocol: UDP\n  - name: dns-tcp\n    port: 53\n    protocol: TCP\n"
        ),
        slice("dual-dns-v6", "dual-dns", "IPv6", endpoints(dns, true), DNS_PORTS),
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: dual-empty\n  namespace: default\nspec:\n  clusterIP: {EMPTY_VIP4}\n  clusterIPs: [{EMPTY_VIP4}, \"{EMPTY_VIP6}\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: PreferDualStack\n  ports:\n  - name: http\n    port: 80\n  - name: dns\n    port: 53\n    protocol: UDP\n"
        ),
    ]
    .join("---\n")
}

/// [`WEB_PODS6`] with nginx and [`DNS_PODS6`] with dnsmasq, in `cluster`.
pub fn start_pods(cluster: &Cluster) -> (Vec<Pod>, Vec<Pod>) {
    let web = WEB_PODS6
        .iter()
        .map(|(name, ip)| {
            let pod = dual_pod(cluster, name, *ip);
            pod.start_nginx(&format!("{name}\n")).unwrap();
            pod
        })
        .collect();
    let dns = DNS_PODS6
        .iter()
        .map(|(name, ip)| {
            let pod = dual_pod(cluster, name, *ip);
            pod.start_dnsmasq(Ipv4Addr::new(10, 96, 0, 200)).unwrap();
            pod
        })
        .collect();
    (web, dns)
}
