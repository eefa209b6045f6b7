//! The node's side of north–south traffic: which of its addresses answer
//! NodePorts (`--nodeport-addresses`, as kube-proxy, per IP family), which
//! interfaces are external (they get the external programs, and their
//! addresses — one IPv4, one IPv6 — are those SNATed flows leave with), and the
//! datapath's NODEPORT_CONFIG.

use std::{
    collections::BTreeMap,
    ffi::CStr,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use anyhow::{Context as _, Result};
use proxy_common::maps::{DEFAULT_SNAT_PORT_MAX, DEFAULT_SNAT_PORT_MIN, ExternalIfaceV4, NodePortConfigV4};
use proxy_common::maps_v6::{ExternalIfaceV6, NodePortConfigV6};

use crate::{
    bpf::{InterfaceSelector, Maps},
    net::Cidr4,
};

/// The north–south flags of `kproxy agent`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NorthSouthOptions {
    /// `--nodeport-addresses`: where NodePorts answer.
    pub nodeport_addresses: NodePortAddresses,
    /// `--cluster-cidr`: clients outside it reaching a cluster IP through an
    /// external interface are masqueraded.
    pub cluster_cidr: Option<Cidr4>,
    /// `--cluster-cidr`'s IPv6 prefix, the same for IPv6 clients.
    pub cluster_cidr6: Option<Cidr6>,
    /// `--external-interfaces`: by name; empty: every interface holding a
    /// usable address that is not pod-facing.
    pub external_interfaces: Vec<String>,
    /// `--snat-port-range`, inclusive.
    pub snat_ports: (u16, u16),
    /// `--xdp`.
    pub xdp: crate::bpf::XdpSetting,
    /// `--maglev-seed`.
    pub maglev_seed: u32,
}

impl Default for NorthSouthOptions {
    fn default() -> Self {
        Self {
            nodeport_addresses: NodePortAddresses::All,
            cluster_cidr: None,
            cluster_cidr6: None,
            external_interfaces: Vec::new(),
            snat_ports: (DEFAULT_SNAT_PORT_MIN, DEFAULT_SNAT_PORT_MAX),
            xdp: crate::bpf::XdpSetting::Native,
            maglev_seed: 0,
        }
    }
}

impl NorthSouthOptions {
    pub fn config(&self) -> NodePortConfigV4 {
        let (cluster_cidr, prefix) = match self.cluster_cidr {
            Some(cidr) => (cidr.addr.octets(), cidr.prefix_len),
            None => ([0; 4], 0),
        };
        NodePortConfigV4 {
            snat_port_min: self.snat_ports.0,
            snat_port_max: self.snat_ports.1,
            cluster_cidr,
            cluster_cidr_prefix: prefix,
            _pad: [0; 3],
            maglev_seed: self.maglev_seed,
        }
    }

    /// NODEPORT_CONFIG_V6's value.
    pub fn config6(&self) -> NodePortConfigV6 {
        NodePortConfigV6::new(self.cluster_cidr6.map(|cidr| (cidr.addr.octets(), cidr.prefix_len)))
    }
}

/// `--nodeport-addresses` as kube-proxy reads it (`NewNodePortAddresses`, once per IP family).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Unset: every address of the external interfaces, kube-proxy's default in its iptables mode.
    #[default]
    All,
    /// The node addresses inside these prefixes, per family: a family none of them is of answers
    /// on every address of that family (kube-proxy's per-family zero CIDR).
    Cidrs { v4: Vec<Cidr4>, v6: Vec<Cidr6> },
    /// `primary`: the node's primary IPv4 address: the first IPv4 InternalIP, then ExternalIP,
    /// of its Node object (kube-proxy's `GetNodeHostIPs`), or with `--manifests` the address of
    /// the interface holding the default route. The primary IPv6 address is not read yet, so
    /// `primary` answers IPv6 NodePorts nowhere.
    Primary,
}

/// An IPv6 prefix of `--nodeport-addresses`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cidr6 {
    pub addr: Ipv6Addr,
    pub prefix_len: u8,
}

impl Cidr6 {
    pub fn contains(&self, addr: Ipv6Addr) -> bool {
        let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix_len)).unwrap_or(0);
        u128::from(addr) & mask == u128::from(self.addr) & mask
    }
}

impl std::fmt::Display for Cidr6 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

/// The keyword for the node's primary addresses (kube-proxy's `NodePortAddressesPrimary`).
pub const PRIMARY: &str = "primary";

impl NodePortAddresses {
    /// kube-proxy's rules: `primary` alone, or CIDRs of either family (without one of a family,
    /// that family's NodePorts answer on every address, as kube-proxy's per-family filter does).
    pub fn parse(values: &[String]) -> Result<Self, String> {
        let values: Vec<&str> = values.iter().map(|v| v.trim()).filter(|v| !v.is_empty()).collect();
        if values.contains(&PRIMARY) {
            if values.len() != 1 {
                return Err(format!("{values:?}: can't use both '{PRIMARY}' and CIDRs"));
            }
            return Ok(Self::Primary);
        }
        let (mut v4, mut v6) = (Vec::new(), Vec::new());
        for value in &values {
            if value.contains(':') {
                v6.push(parse_cidr6(value)?);
            } else {
                v4.push(
                    value
                        .parse::<Cidr4>()
                        .map_err(|e| format!("{e} (must be a valid CIDR or '{PRIMARY}')"))?,
                );
            }
        }
        Ok(if v4.is_empty() && v6.is_empty() { Self::All } else { Self::Cidrs { v4, v6 } })
    }

    /// Whether NodePorts answer on `addr`, given the node's primary IPv4 address (`None`: not
    /// known yet, so `primary` admits nothing).
    pub fn admits(&self, addr: IpAddr, primary: Option<Ipv4Addr>) -> bool {
        match (self, addr) {
            (Self::All, _) => true,
            (Self::Cidrs { v4, .. }, IpAddr::V4(addr)) => {
                v4.is_empty() || v4.iter().any(|c| c.contains(addr))
            }
            (Self::Cidrs { v6, .. }, IpAddr::V6(addr)) => {
                v6.is_empty() || v6.iter().any(|c| c.contains(addr))
            }
            (Self::Primary, IpAddr::V4(addr)) => primary == Some(addr),
            (Self::Primary, IpAddr::V6(_)) => false,
        }
    }

    /// As a KubeProxyConfiguration writes `nodePortAddresses`.
    pub fn to_strings(&self) -> Vec<String> {
        match self {
            Self::All => Vec::new(),
            Self::Cidrs { v4, v6 } => {
                v4.iter().map(ToString::to_string).chain(v6.iter().map(ToString::to_string)).collect()
            }
            Self::Primary => vec![PRIMARY.to_string()],
        }
    }
}

/// An IPv6 CIDR (its address masked to the prefix, as kube-proxy's ParseCIDR does).
fn parse_cidr6(text: &str) -> Result<Cidr6, String> {
    let bad = || format!("{text:?} is not a valid CIDR");
    let (addr, len) = text.split_once('/').ok_or_else(bad)?;
    let addr = addr.parse::<Ipv6Addr>().map_err(|_| bad())?;
    let prefix_len = len.parse::<u8>().ok().filter(|&l| l <= 128).ok_or_else(bad)?;
    let mask = u128::MAX.checked_shl(128 - u32::from(prefix_len)).unwrap_or(0);
    Ok(Cidr6 { addr: Ipv6Addr::from(u128::from(addr) & mask), prefix_len })
}

/// `--cluster-cidr` (kube-proxy's `clusterCIDR`): one CIDR, or a comma-separated dual-stack pair.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterCidrs {
    pub ipv4: Option<Cidr4>,
    pub ipv6: Option<Cidr6>,
}

impl ClusterCidrs {
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut out = Self::default();
        for value in text.split(',').map(str::trim).filter(|v| !v.is_empty()) {
            if value.contains(':') {
                if out.ipv6.replace(parse_cidr6(value)?).is_some() {
                    return Err(format!("{text:?}: at most one CIDR per IP family (a dual-stack pair)"));
                }
            } else {
                let cidr = value.parse::<Cidr4>()?;
                if out.ipv4.replace(cidr).is_some() {
                    return Err(format!("{text:?}: at most one CIDR per IP family (a dual-stack pair)"));
                }
            }
        }
        Ok(out)
    }

    /// As a KubeProxyConfiguration writes `clusterCIDR`.
    pub fn to_config_string(&self) -> String {
        let v4 = self.ipv4.map(|c| c.to_string());
        v4.into_iter().chain(self.ipv6.map(|c| c.to_string())).collect::<Vec<_>>().join(",")
    }
}

/// `--snat-port-range`: `min-max`, inside 1024-65535.
pub fn parse_port_range(text: &str) -> Result<(u16, u16), String> {
    let (min, max) = text.split_once('-').ok_or_else(|| format!("{text:?}: expected MIN-MAX"))?;
    let parse = |p: &str| p.trim().parse::<u16>().map_err(|_| format!("{text:?}: {p:?} is not a port"));
    let (min, max) = (parse(min)?, parse(max)?);
    if min < 1024 || min > max {
        return Err(format!("{text:?}: the range must be inside 1024-65535 and MIN <= MAX"));
    }
    Ok((min, max))
}

/// One address (IPv4 or IPv6) of an interface in this network namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LocalAddress {
    pub interface: String,
    pub index: u32,
    pub addr: IpAddr,
}

/// The IPv4 and IPv6 addresses of this network namespace's interfaces.
pub fn local_addresses() -> Result<Vec<LocalAddress>> {
    let mut out = addresses_in_kernel_order()?;
    out.sort();
    Ok(out)
}

/// As getifaddrs lists them: an interface's primary address before its secondary ones.
fn addresses_in_kernel_order() -> Result<Vec<LocalAddress>> {
    let mut out = Vec::new();
    // SAFETY: getifaddrs fills a list we walk read-only and free once.
    unsafe {
        let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut list) != 0 {
            return Err(std::io::Error::last_os_error()).context("getifaddrs");
        }
        let mut cursor = list;
        while !cursor.is_null() {
            let entry = &*cursor;
            cursor = entry.ifa_next;
            if entry.ifa_addr.is_null() {
                continue;
            }
            let addr = match i32::from((*entry.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(entry.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(entry.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
                }
                _ => continue,
            };
            let interface = CStr::from_ptr(entry.ifa_name).to_string_lossy().into_owned();
            let index = libc::if_nametoindex(entry.ifa_name);
            out.push(LocalAddress { interface, index, addr });
        }
        libc::freeifaddrs(list);
    }
    Ok(out)
}

/// The node's primary address without a Node object (`--nodeport-addresses primary` with
/// `--manifests`): the primary address of the interface holding the default route (the lowest
/// metric), read from this network namespace's /proc/net/route.
pub fn default_route_address() -> Result<Ipv4Addr> {
    let routes = std::fs::read_to_string("/proc/net/route").context("reading /proc/net/route")?;
    let interface = default_route_interface(&routes).ok_or_else(|| {
        anyhow::anyhow!(
            "--nodeport-addresses {PRIMARY}: no default route in this network namespace, so without a \
             Node object there is no primary address; give the node's CIDRs instead \
             (e.g. --nodeport-addresses 192.168.1.0/24)"
        )
    })?;
    addresses_in_kernel_order()?
        .into_iter()
        .find_map(|a| match a.addr {
            IpAddr::V4(addr) if a.interface == interface && !addr.is_loopback() => Some(addr),
            _ => None,
        })
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--nodeport-addresses {PRIMARY}: {interface}, which holds the default route, has no IPv4 \
                 address; give the node's CIDRs instead"
            )
        })
}

/// The interface of the IPv4 default route with the lowest metric in /proc/net/route's text.
fn default_route_interface(routes: &str) -> Option<String> {
    const RTF_UP: u32 = 0x1;
    routes
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (iface, destination, flags, metric, mask) =
                (fields.first()?, fields.get(1)?, fields.get(3)?, fields.get(6)?, fields.get(7)?);
            let flags = u32::from_str_radix(flags, 16).ok()?;
            let default = *destination == "00000000" && *mask == "00000000" && flags & RTF_UP != 0;
            default.then(|| (metric.parse::<u32>().unwrap_or(u32::MAX), iface.to_string()))
        })
        .min()
        .map(|(_, iface)| iface)
}

/// What the node answers north–south traffic on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeAddresses {
    /// Where NodePorts are answered, IPv4 addresses before IPv6 ones.
    pub nodeport: Vec<IpAddr>,
    /// External interfaces with an IPv4 address, by name, with their index and the
    /// address their SNATed IPv4 flows use.
    pub external: Vec<LocalAddress>,
    /// External interfaces with a global IPv6 address, and the one their SNATed IPv6
    /// flows use.
    pub external6: Vec<LocalAddress>,
}

impl NodeAddresses {
    /// The external interfaces, of either family, each once.
    pub fn interface_names(&self) -> Vec<String> {
        let mut names: Vec<String> =
            self.external.iter().chain(&self.external6).map(|a| a.interface.clone()).collect();
        names.sort();
        names.dedup();
        names
    }
}

/// Whether `addr` can be a NodePort or SNAT address: not loopback, link-local,
/// unspecified or multicast (nor IPv4-mapped).
fn usable_address(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => !a.is_loopback() && !a.is_link_local() && !a.is_unspecified(),
        IpAddr::V6(a) => {
            !a.is_loopback()
                && !a.is_unicast_link_local()
                && !a.is_unspecified()
                && !a.is_multicast()
                && a.to_ipv4_mapped().is_none()
        }
    }
}

/// Applies the options to the node's addresses. Loopback and link-local
/// addresses and pod-facing interfaces are never external. `primary` is the
/// node's primary address, for `--nodeport-addresses primary` (`None`: unknown).
pub fn select(
    options: &NorthSouthOptions,
    local: &[LocalAddress],
    pods: &InterfaceSelector,
    primary: Option<Ipv4Addr>,
) -> NodeAddresses {
    let usable = |a: &&LocalAddress| usable_address(a.addr) && !pods.matches(&a.interface);
    let external_iface = |a: &&LocalAddress| {
        options.external_interfaces.is_empty() || options.external_interfaces.contains(&a.interface)
    };
    let candidates: Vec<&LocalAddress> = local.iter().filter(usable).filter(external_iface).collect();
    let (mut first_v4, mut first_v6): (BTreeMap<&str, &LocalAddress>, BTreeMap<&str, &LocalAddress>) =
        Default::default();
    for a in &candidates {
        let first = if a.addr.is_ipv4() { &mut first_v4 } else { &mut first_v6 };
        first.entry(a.interface.as_str()).or_insert(a);
    }
    let mut nodeport: Vec<IpAddr> = candidates
        .iter()
        .filter(|a| options.nodeport_addresses.admits(a.addr, primary))
        .map(|a| a.addr)
        .collect();
    nodeport.sort();
    nodeport.dedup();
    NodeAddresses {
        nodeport,
        external: first_v4.into_values().cloned().collect(),
        external6: first_v6.into_values().cloned().collect(),
    }
}

/// Writes NODEPORT_CONFIG and NODEPORT_CONFIG_V6 and makes EXTERNAL_IFACES and EXTERNAL_IFACES_V6 hold
/// exactly `addresses`'s interfaces. Returns whether anything changed.
pub fn write_maps(maps: &mut Maps, options: &NorthSouthOptions, addresses: &NodeAddresses) -> Result<bool> {
    let mut changed = false;
    let config = options.config();
    if maps.nodeport_config.get(&0, 0).ok() != Some(config) {
        maps.nodeport_config.set(0, config, 0).context("writing NODEPORT_CONFIG[0]")?;
        changed = true;
    }
    let config6 = options.config6();
    if maps.nodeport_config_v6.get(&0, 0).ok() != Some(config6) {
        maps.nodeport_config_v6.set(0, config6, 0).context("writing NODEPORT_CONFIG_V6[0]")?;
        changed = true;
    }
    let wanted: BTreeMap<u32, ExternalIfaceV4> = addresses
        .external
        .iter()
        .filter_map(|a| match a.addr {
            IpAddr::V4(addr) => Some((a.index, ExternalIfaceV4 { addr: addr.octets(), _pad: 0 })),
            IpAddr::V6(_) => None,
        })
        .collect();
    changed |= write_external(&mut maps.external_ifaces, &wanted, "EXTERNAL_IFACES")?;
    let wanted6: BTreeMap<u32, ExternalIfaceV6> = addresses
        .external6
        .iter()
        .filter_map(|a| match a.addr {
            IpAddr::V6(addr) => Some((a.index, ExternalIfaceV6 { addr: addr.octets() })),
            IpAddr::V4(_) => None,
        })
        .collect();
    changed |= write_external(&mut maps.external_ifaces_v6, &wanted6, "EXTERNAL_IFACES_V6")?;
    Ok(changed)
}

/// Makes `map` (`name`) hold exactly `wanted`. Returns whether anything changed.
fn write_external<V: aya::Pod + PartialEq>(
    map: &mut aya::maps::HashMap<aya::maps::MapData, u32, V>,
    wanted: &BTreeMap<u32, V>,
    name: &str,
) -> Result<bool> {
    let mut changed = false;
    let present: Vec<(u32, V)> =
        map.iter().collect::<Result<_, _>>().with_context(|| format!("reading {name}"))?;
    for (index, value) in &present {
        if wanted.get(index) != Some(value) {
            let _ = map.remove(index);
            changed = true;
        }
    }
    for (index, value) in wanted {
        if !present.iter().any(|(i, v)| i == index && v == value) {
            map.insert(index, value, 0).with_context(|| format!("writing {name}"))?;
            changed = true;
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(interface: &str, index: u32, a: [u8; 4]) -> LocalAddress {
        LocalAddress { interface: interface.into(), index, addr: Ipv4Addr::from(a).into() }
    }

    fn addr6(interface: &str, index: u32, a: &str) -> LocalAddress {
        LocalAddress { interface: interface.into(), index, addr: a.parse::<Ipv6Addr>().unwrap().into() }
    }

    /// [`node`] with IPv6: link-local addresses everywhere, global ones on eth0 and a pod veth.
    fn dual_stack_node() -> Vec<LocalAddress> {
        let mut local = node();
        local.extend([
            addr6("lo", 1, "::1"),
            addr6("eth0", 2, "fe80::1"),
            addr6("eth0", 2, "fd00:192:168:100::10"),
            addr6("eth0", 2, "fd00:192:168:100::50"),
            addr6("eth1", 3, "fe80::2"),
            addr6("veth2", 5, "fd00:10:244::1"),
        ]);
        local
    }

    fn ips(addrs: &[&str]) -> Vec<IpAddr> {
        addrs.iter().map(|a| a.parse().unwrap()).collect()
    }

    fn node() -> Vec<LocalAddress> {
        vec![
            addr("lo", 1, [127, 0, 0, 1]),
            addr("eth0", 2, [192, 168, 100, 10]),
            addr("eth0", 2, [192, 168, 100, 50]),
            addr("eth1", 3, [10, 0, 0, 10]),
            addr("veth1", 4, [169, 254, 1, 1]),
            addr("veth2", 5, [10, 244, 0, 1]),
        ]
    }

    fn pods() -> InterfaceSelector {
        InterfaceSelector::new(&["veth*".to_string()]).unwrap()
    }

    #[test]
    fn by_default_every_usable_address_answers_nodeports() {
        let selected = select(&NorthSouthOptions::default(), &node(), &pods(), None);
        assert_eq!(selected.nodeport, ips(&["10.0.0.10", "192.168.100.10", "192.168.100.50"]));
        assert_eq!(selected.interface_names(), ["eth0", "eth1"]);
        assert_eq!(
            selected.external[0].addr,
            Ipv4Addr::new(192, 168, 100, 10),
            "first address of eth0 for SNAT"
        );
        assert!(selected.external6.is_empty());
    }

    #[test]
    fn global_ipv6_addresses_answer_nodeports_and_the_first_one_snats() {
        let selected = select(&NorthSouthOptions::default(), &dual_stack_node(), &pods(), None);
        assert_eq!(
            selected.nodeport,
            ips(&[
                "10.0.0.10",
                "192.168.100.10",
                "192.168.100.50",
                "fd00:192:168:100::10",
                "fd00:192:168:100::50"
            ]),
            "no loopback, link-local or pod-facing address"
        );
        // eth1 has only a link-local IPv6 address: no IPv6 SNAT address there.
        assert_eq!(selected.external6, vec![addr6("eth0", 2, "fd00:192:168:100::10")]);
        assert_eq!(selected.interface_names(), ["eth0", "eth1"]);
    }

    #[test]
    fn nodeport_addresses_select_per_family_as_kube_proxy() {
        let only = |values: &[&str]| NorthSouthOptions {
            nodeport_addresses: NodePortAddresses::parse(
                &values.iter().map(|v| v.to_string()).collect::<Vec<_>>(),
            )
            .unwrap(),
            ..Default::default()
        };
        let selected = |values: &[&str]| select(&only(values), &dual_stack_node(), &pods(), None).nodeport;
        // An IPv6 CIDR selects IPv6 addresses; IPv4 ones all answer (no IPv4 CIDR given).
        assert_eq!(
            selected(&["fd00:192:168:100::50/128"]),
            ips(&["10.0.0.10", "192.168.100.10", "192.168.100.50", "fd00:192:168:100::50"])
        );
        // An IPv4 CIDR alone leaves every IPv6 address answering.
        assert_eq!(
            selected(&["10.0.0.0/8"]),
            ips(&["10.0.0.10", "fd00:192:168:100::10", "fd00:192:168:100::50"])
        );
        assert_eq!(selected(&["10.0.0.0/8", "fd00:192:168:100::/64"]).len(), 3);
        assert!(selected(&["10.0.0.0/8", "fd00:1::/64"]).iter().all(IpAddr::is_ipv4));
        // The primary IPv6 address is not known: `primary` answers IPv4 only.
        let primary = Ipv4Addr::new(192, 168, 100, 50);
        let options =
            NorthSouthOptions { nodeport_addresses: NodePortAddresses::Primary, ..Default::default() };
        assert_eq!(
            select(&options, &dual_stack_node(), &pods(), Some(primary)).nodeport,
            vec![IpAddr::V4(primary)]
        );
    }

    #[test]
    fn nodeport_addresses_filter_by_prefix() {
        let options = NorthSouthOptions {
            nodeport_addresses: NodePortAddresses::Cidrs {
                v4: vec!["192.168.100.0/28".parse().unwrap()],
                v6: Vec::new(),
            },
            ..Default::default()
        };
        let selected = select(&options, &node(), &pods(), None);
        assert_eq!(selected.nodeport, ips(&["192.168.100.10"]));
    }

    #[test]
    fn primary_answers_on_the_primary_address_only_once_known() {
        let options =
            NorthSouthOptions { nodeport_addresses: NodePortAddresses::Primary, ..Default::default() };
        let primary = Ipv4Addr::new(192, 168, 100, 50);
        assert_eq!(select(&options, &node(), &pods(), Some(primary)).nodeport, vec![IpAddr::V4(primary)]);
        assert!(select(&options, &node(), &pods(), None).nodeport.is_empty());
        // A primary address the node does not hold answers nothing.
        assert!(select(&options, &node(), &pods(), Some(Ipv4Addr::new(192, 0, 2, 1))).nodeport.is_empty());
        // External interfaces do not depend on it.
        assert_eq!(select(&options, &node(), &pods(), None).interface_names(), ["eth0", "eth1"]);
    }

    #[test]
    fn nodeport_addresses_as_kube_proxy_validates_them() {
        let parse = |values: &[&str]| {
            NodePortAddresses::parse(&values.iter().map(|v| v.to_string()).collect::<Vec<_>>())
        };
        assert_eq!(parse(&[]), Ok(NodePortAddresses::All));
        assert_eq!(parse(&["primary"]), Ok(NodePortAddresses::Primary));
        assert_eq!(
            parse(&["10.0.0.0/8", "192.168.1.0/24"]),
            Ok(NodePortAddresses::Cidrs {
                v4: vec!["10.0.0.0/8".parse().unwrap(), "192.168.1.0/24".parse().unwrap()],
                v6: Vec::new()
            })
        );
        assert!(
            parse(&["primary", "10.0.0.0/8"]).unwrap_err().contains("can't use both 'primary' and CIDRs")
        );
        assert!(parse(&["foo"]).unwrap_err().contains("must be a valid CIDR"));
        // IPv6 CIDRs select IPv6 addresses (masked to their prefix); per family, see
        // `nodeport_addresses_select_per_family_as_kube_proxy`.
        let fd00 = Cidr6 { addr: "fd00::".parse().unwrap(), prefix_len: 64 };
        assert_eq!(parse(&["fd00::1/64"]), Ok(NodePortAddresses::Cidrs { v4: Vec::new(), v6: vec![fd00] }));
        assert_eq!(
            parse(&["fd00::/64", "10.0.0.0/8"]),
            Ok(NodePortAddresses::Cidrs { v4: vec!["10.0.0.0/8".parse().unwrap()], v6: vec![fd00] })
        );
        assert_eq!(parse(&["fd00::/64", "10.0.0.0/8"]).unwrap().to_strings(), ["10.0.0.0/8", "fd00::/64"]);
        assert!(parse(&["fd00::/129"]).is_err());
        assert_eq!(NodePortAddresses::Primary.to_strings(), ["primary"]);
    }

    #[test]
    fn cluster_cidr_takes_a_dual_stack_pair() {
        let dual = ClusterCidrs::parse("10.244.0.0/16,fd00:10:244::/56").unwrap();
        assert_eq!(dual.ipv4, Some("10.244.0.0/16".parse().unwrap()));
        assert_eq!(dual.ipv6.map(|c| c.to_string()).as_deref(), Some("fd00:10:244::/56"));
        assert_eq!(dual.to_config_string(), "10.244.0.0/16,fd00:10:244::/56");
        assert_eq!(ClusterCidrs::parse("fd00:10:244::/56").unwrap().ipv4, None);
        assert!(
            ClusterCidrs::parse("10.244.0.0/16,10.245.0.0/16")
                .unwrap_err()
                .contains("one CIDR per IP family")
        );
        assert!(ClusterCidrs::parse("10.244.0.0/33").is_err());
        assert!(ClusterCidrs::parse("fd00::/200").is_err());
        assert_eq!(ClusterCidrs::parse("").unwrap(), ClusterCidrs::default());
    }

    #[test]
    fn the_default_route_with_the_lowest_metric() {
        let routes = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                      eth1\t00000000\t0100000A\t0003\t0\t0\t200\t00000000\t0\t0\t0\n\
                      eth0\t00000000\t0164A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n\
                      eth0\t0064A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";
        assert_eq!(default_route_interface(routes).as_deref(), Some("eth0"));
        let no_default = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n\
                          eth0\t0064A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n";
        assert_eq!(default_route_interface(no_default), None);
    }

    #[test]
    fn external_interfaces_by_name() {
        let options = NorthSouthOptions { external_interfaces: vec!["eth1".into()], ..Default::default() };
        let selected = select(&options, &node(), &pods(), None);
        assert_eq!(selected.interface_names(), ["eth1"]);
        assert_eq!(selected.nodeport, ips(&["10.0.0.10"]));
    }

    #[test]
    fn port_ranges() {
        assert_eq!(parse_port_range("61000-65535"), Ok((61000, 65535)));
        assert!(parse_port_range("100-200").is_err());
        assert!(parse_port_range("5000-4000").is_err());
        assert!(parse_port_range("5000").is_err());
        assert!(parse_port_range("5000-70000").is_err());
    }

    #[test]
    fn config_carries_range_and_cidr() {
        let options = NorthSouthOptions {
            cluster_cidr: Some("10.244.0.0/16".parse().unwrap()),
            snat_ports: (40000, 40010),
            ..Default::default()
        };
        let config = options.config();
        assert_eq!(config.port_range(), (40000, 40010));
        assert!(config.in_cluster_cidr([10, 244, 9, 9]));
        assert!(!config.in_cluster_cidr([192, 168, 100, 200]));
        let no_prefix = options.config6();
        assert!(!no_prefix.outside_cluster_cidr(&"fd00:192:168::1".parse::<Ipv6Addr>().unwrap().octets()));
        let dual = ClusterCidrs::parse("10.244.0.0/16,fd00:10:244::/56").unwrap();
        let options = NorthSouthOptions { cluster_cidr: dual.ipv4, cluster_cidr6: dual.ipv6, ..options };
        let config6 = options.config6();
        assert!(config6.in_cluster_cidr(&"fd00:10:244:1::11".parse::<Ipv6Addr>().unwrap().octets()));
        assert!(!config6.in_cluster_cidr(&"fd00:192:168:100::200".parse::<Ipv6Addr>().unwrap().octets()));
    }
}
