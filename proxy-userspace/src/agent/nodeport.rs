//! The node's side of north–south traffic: which of its addresses answer
//! NodePorts (`--nodeport-addresses`, as kube-proxy), which interfaces are
//! external (they get the external programs, and their address is the one
//! SNATed flows leave with), and the datapath's NODEPORT_CONFIG.

use std::{
    collections::BTreeMap,
    ffi::CStr,
    net::{Ipv4Addr, Ipv6Addr},
};

use anyhow::{Context as _, Result};
use proxy_common::maps::{DEFAULT_SNAT_PORT_MAX, DEFAULT_SNAT_PORT_MIN, ExternalIfaceV4, NodePortConfigV4};

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
}

/// `--nodeport-addresses` as kube-proxy reads it (`NewNodePortAddresses`, for IPv4).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Unset (or no IPv4 CIDR among those given): every address of the external interfaces,
    /// kube-proxy's default in its iptables mode.
    #[default]
    All,
    /// The node addresses inside these prefixes.
    Cidrs(Vec<Cidr4>),
    /// `primary`: the node's primary IPv4 address: the first IPv4 InternalIP, then ExternalIP,
    /// of its Node object (kube-proxy's `GetNodeHostIPs`), or with `--manifests` the address of
    /// the interface holding the default route.
    Primary,
}

/// The keyword for the node's primary addresses (kube-proxy's `NodePortAddressesPrimary`).
pub const PRIMARY: &str = "primary";

impl NodePortAddresses {
    /// kube-proxy's rules: `primary` alone, or CIDRs of either family (IPv6 ones are valid but
    /// serve nothing yet; without an IPv4 one, IPv4 NodePorts answer on every address, as
    /// kube-proxy's per-family filter does).
    pub fn parse(values: &[String]) -> Result<Self, String> {
        let values: Vec<&str> = values.iter().map(|v| v.trim()).filter(|v| !v.is_empty()).collect();
        if values.contains(&PRIMARY) {
            if values.len() != 1 {
                return Err(format!("{values:?}: can't use both '{PRIMARY}' and CIDRs"));
            }
            return Ok(Self::Primary);
        }
        let mut cidrs = Vec::new();
        for value in &values {
            if value.contains(':') {
                parse_cidr6(value)?;
            } else {
                cidrs.push(
                    value
                        .parse::<Cidr4>()
                        .map_err(|e| format!("{e} (must be a valid CIDR or '{PRIMARY}')"))?,
                );
            }
        }
        Ok(if cidrs.is_empty() { Self::All } else { Self::Cidrs(cidrs) })
    }

    /// Whether NodePorts answer on `addr`, given the node's primary address (`None`: not known
    /// yet, so `primary` admits nothing).
    pub fn admits(&self, addr: Ipv4Addr, primary: Option<Ipv4Addr>) -> bool {
        match self {
            Self::All => true,
            Self::Cidrs(cidrs) => cidrs.iter().any(|c| c.contains(addr)),
            Self::Primary => primary == Some(addr),
        }
    }

    /// As a KubeProxyConfiguration writes `nodePortAddresses`.
    pub fn to_strings(&self) -> Vec<String> {
        match self {
            Self::All => Vec::new(),
            Self::Cidrs(cidrs) => cidrs.iter().map(ToString::to_string).collect(),
            Self::Primary => vec![PRIMARY.to_string()],
        }
    }
}

/// An IPv6 CIDR, checked only: kproxy serves IPv4.
fn parse_cidr6(text: &str) -> Result<(), String> {
    let bad = || format!("{text:?} is not a valid CIDR");
    let (addr, len) = text.split_once('/').ok_or_else(bad)?;
    addr.parse::<Ipv6Addr>().map_err(|_| bad())?;
    len.parse::<u8>().ok().filter(|&l| l <= 128).ok_or_else(bad)?;
    Ok(())
}

/// `--cluster-cidr` (kube-proxy's `clusterCIDR`): one CIDR, or a comma-separated dual-stack pair.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterCidrs {
    /// The IPv4 one: the only one kproxy uses.
    pub ipv4: Option<Cidr4>,
    /// The IPv6 one, as given: accepted, not served yet.
    pub ipv6: Option<String>,
}

impl ClusterCidrs {
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut out = Self::default();
        for value in text.split(',').map(str::trim).filter(|v| !v.is_empty()) {
            if value.contains(':') {
                parse_cidr6(value)?;
                if out.ipv6.replace(value.to_string()).is_some() {
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
        v4.into_iter().chain(self.ipv6.clone()).collect::<Vec<_>>().join(",")
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

/// One IPv4 address of an interface in this network namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LocalAddress {
    pub interface: String,
    pub index: u32,
    pub addr: Ipv4Addr,
}

/// The IPv4 addresses of this network namespace's interfaces.
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
            if entry.ifa_addr.is_null() || i32::from((*entry.ifa_addr).sa_family) != libc::AF_INET {
                continue;
            }
            let sin = &*(entry.ifa_addr as *const libc::sockaddr_in);
            let addr = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
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
        .find(|a| a.interface == interface && !a.addr.is_loopback())
        .map(|a| a.addr)
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
    /// Where NodePorts are answered.
    pub nodeport: Vec<Ipv4Addr>,
    /// External interfaces, by name, with their index and the address their
    /// SNATed flows use.
    pub external: Vec<LocalAddress>,
}

impl NodeAddresses {
    pub fn interface_names(&self) -> Vec<String> {
        self.external.iter().map(|a| a.interface.clone()).collect()
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
    let usable = |a: &&LocalAddress| {
        !a.addr.is_loopback()
            && !a.addr.is_link_local()
            && !a.addr.is_unspecified()
            && !pods.matches(&a.interface)
    };
    let external_iface = |a: &&LocalAddress| {
        options.external_interfaces.is_empty() || options.external_interfaces.contains(&a.interface)
    };
    let candidates: Vec<&LocalAddress> = local.iter().filter(usable).filter(external_iface).collect();
    let mut first_by_interface: BTreeMap<&str, &LocalAddress> = BTreeMap::new();
    for a in &candidates {
        first_by_interface.entry(a.interface.as_str()).or_insert(a);
    }
    let mut nodeport: Vec<Ipv4Addr> = candidates
        .iter()
        .filter(|a| options.nodeport_addresses.admits(a.addr, primary))
        .map(|a| a.addr)
        .collect();
    nodeport.sort();
    nodeport.dedup();
    NodeAddresses { nodeport, external: first_by_interface.into_values().cloned().collect() }
}

/// Writes NODEPORT_CONFIG and makes EXTERNAL_IFACES hold exactly `addresses`'s
/// interfaces. Returns whether anything changed.
pub fn write_maps(maps: &mut Maps, options: &NorthSouthOptions, addresses: &NodeAddresses) -> Result<bool> {
    let mut changed = false;
    let config = options.config();
    if maps.nodeport_config.get(&0, 0).ok() != Some(config) {
        maps.nodeport_config.set(0, config, 0).context("writing NODEPORT_CONFIG[0]")?;
        changed = true;
    }
    let wanted: BTreeMap<u32, ExternalIfaceV4> = addresses
        .external
        .iter()
        .map(|a| (a.index, ExternalIfaceV4 { addr: a.addr.octets(), _pad: 0 }))
        .collect();
    let present: Vec<(u32, ExternalIfaceV4)> =
        maps.external_ifaces.iter().collect::<Result<_, _>>().context("reading EXTERNAL_IFACES")?;
    for (index, value) in &present {
        if wanted.get(index) != Some(value) {
            let _ = maps.external_ifaces.remove(index);
            changed = true;
        }
    }
    for (index, value) in &wanted {
        if !present.iter().any(|(i, v)| i == index && v == value) {
            maps.external_ifaces.insert(index, value, 0).context("writing EXTERNAL_IFACES")?;
            changed = true;
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(interface: &str, index: u32, a: [u8; 4]) -> LocalAddress {
        LocalAddress { interface: interface.into(), index, addr: Ipv4Addr::from(a) }
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
        let want: Vec<Ipv4Addr> =
            vec![[10, 0, 0, 10].into(), [192, 168, 100, 10].into(), [192, 168, 100, 50].into()];
        assert_eq!(selected.nodeport, want);
        assert_eq!(selected.interface_names(), ["eth0", "eth1"]);
        assert_eq!(
            selected.external[0].addr,
            Ipv4Addr::new(192, 168, 100, 10),
            "first address of eth0 for SNAT"
        );
    }

    #[test]
    fn nodeport_addresses_filter_by_prefix() {
        let options = NorthSouthOptions {
            nodeport_addresses: NodePortAddresses::Cidrs(vec!["192.168.100.0/28".parse().unwrap()]),
            ..Default::default()
        };
        let selected = select(&options, &node(), &pods(), None);
        assert_eq!(selected.nodeport, vec![Ipv4Addr::new(192, 168, 100, 10)]);
    }

    #[test]
    fn primary_answers_on_the_primary_address_only_once_known() {
        let options =
            NorthSouthOptions { nodeport_addresses: NodePortAddresses::Primary, ..Default::default() };
        let primary = Ipv4Addr::new(192, 168, 100, 50);
        assert_eq!(select(&options, &node(), &pods(), Some(primary)).nodeport, vec![primary]);
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
            Ok(NodePortAddresses::Cidrs(vec![
                "10.0.0.0/8".parse().unwrap(),
                "192.168.1.0/24".parse().unwrap()
            ]))
        );
        assert!(
            parse(&["primary", "10.0.0.0/8"]).unwrap_err().contains("can't use both 'primary' and CIDRs")
        );
        assert!(parse(&["foo"]).unwrap_err().contains("must be a valid CIDR"));
        // IPv6 CIDRs are valid; with no IPv4 one, IPv4 NodePorts answer everywhere (per family).
        assert_eq!(parse(&["fd00::/64"]), Ok(NodePortAddresses::All));
        assert_eq!(
            parse(&["fd00::/64", "10.0.0.0/8"]),
            Ok(NodePortAddresses::Cidrs(vec!["10.0.0.0/8".parse().unwrap()]))
        );
        assert!(parse(&["fd00::/129"]).is_err());
        assert_eq!(NodePortAddresses::Primary.to_strings(), ["primary"]);
    }

    #[test]
    fn cluster_cidr_takes_a_dual_stack_pair() {
        let dual = ClusterCidrs::parse("10.244.0.0/16,fd00:10:244::/56").unwrap();
        assert_eq!(dual.ipv4, Some("10.244.0.0/16".parse().unwrap()));
        assert_eq!(dual.ipv6.as_deref(), Some("fd00:10:244::/56"));
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
        assert_eq!(selected.nodeport, vec![Ipv4Addr::new(10, 0, 0, 10)]);
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
    }
}
