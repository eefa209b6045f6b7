//! The node's side of north–south traffic: which of its addresses answer
//! NodePorts (`--nodeport-addresses`, as kube-proxy), which interfaces are
//! external (they get the external programs, and their address is the one
//! SNATed flows leave with), and the datapath's NODEPORT_CONFIG.

use std::{collections::BTreeMap, ffi::CStr, net::Ipv4Addr};

use anyhow::{Context as _, Result};
use proxy_common::maps::{DEFAULT_SNAT_PORT_MAX, DEFAULT_SNAT_PORT_MIN, ExternalIfaceV4, NodePortConfigV4};

use crate::{
    datapath::{InterfaceSelector, Maps},
    model::Cidr4,
};

/// The north–south flags of `kproxy agent`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NorthSouthOptions {
    /// `--nodeport-addresses`: NodePorts answer on node addresses inside
    /// these prefixes; empty: on every address of the node's external
    /// interfaces.
    pub nodeport_addresses: Vec<Cidr4>,
    /// `--cluster-cidr`: clients outside it reaching a cluster IP through an
    /// external interface are masqueraded.
    pub cluster_cidr: Option<Cidr4>,
    /// `--external-interfaces`: by name; empty: every interface holding a
    /// usable address that is not pod-facing.
    pub external_interfaces: Vec<String>,
    /// `--snat-port-range`, inclusive.
    pub snat_ports: (u16, u16),
    /// `--xdp`.
    pub xdp: crate::datapath::XdpSetting,
    /// `--maglev-seed`.
    pub maglev_seed: u32,
}

impl Default for NorthSouthOptions {
    fn default() -> Self {
        Self {
            nodeport_addresses: Vec::new(),
            cluster_cidr: None,
            external_interfaces: Vec::new(),
            snat_ports: (DEFAULT_SNAT_PORT_MIN, DEFAULT_SNAT_PORT_MAX),
            xdp: crate::datapath::XdpSetting::Native,
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
    out.sort();
    Ok(out)
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
/// addresses and pod-facing interfaces are never external.
pub fn select(
    options: &NorthSouthOptions,
    local: &[LocalAddress],
    pods: &InterfaceSelector,
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
        .filter(|a| {
            options.nodeport_addresses.is_empty()
                || options.nodeport_addresses.iter().any(|c| c.contains(a.addr))
        })
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
        let selected = select(&NorthSouthOptions::default(), &node(), &pods());
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
            nodeport_addresses: vec!["192.168.100.0/28".parse().unwrap()],
            ..Default::default()
        };
        let selected = select(&options, &node(), &pods());
        assert_eq!(selected.nodeport, vec![Ipv4Addr::new(192, 168, 100, 10)]);
    }

    #[test]
    fn external_interfaces_by_name() {
        let options = NorthSouthOptions { external_interfaces: vec!["eth1".into()], ..Default::default() };
        let selected = select(&options, &node(), &pods());
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
