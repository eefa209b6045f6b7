//! Datapath checks: the pinned programs and their links on the selected interfaces, map fill, the
//! north–south and socket-level programs.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

use super::Check;
use crate::bpf::{self, Hook, InterfaceSelector, PinDir};
use crate::coverage::Coverage;

/// The link pin names an interface should have (as `datapath` writes them).
pub fn link_pin_name(name: &str, index: u32, hook: Hook) -> String {
    format!("{}@{index}-{}", name.replace('.', "%2E"), hook.suffix())
}

/// The cgroups the socket hooks sit on when they translate every socket (mode `on`): only then
/// may the agent (`--pod-veth-tc auto`) leave a covered pod's veth without tc programs.
pub fn covering_cgroups(links: &BTreeSet<String>, mode: Option<u32>) -> BTreeSet<PathBuf> {
    if mode != Some(proxy_common::maps::SOCKET_LB_ALL) {
        return BTreeSet::new();
    }
    links.iter().filter_map(|l| bpf::socket_link_cgroup(l)).collect()
}

/// One WARN per matching interface missing a hook, or one OK. An interface with no hook at all
/// whose pod the socket hooks cover (`covered`) needs none: OK.
pub fn attach_checks(
    interfaces: &[bpf::Interface],
    selector: &InterfaceSelector,
    globs: &[String],
    links: &BTreeSet<String>,
    covered: &BTreeSet<String>,
    pin_dir: &Path,
) -> Vec<Check> {
    let wanted: Vec<&bpf::Interface> = interfaces.iter().filter(|i| selector.matches(&i.name)).collect();
    if wanted.is_empty() {
        return vec![no_interface_matches(interfaces, globs)];
    }
    let mut out = Vec::new();
    let (mut attached, mut bare_covered) = (Vec::new(), Vec::new());
    for iface in &wanted {
        let missing = missing_hooks(iface, links);
        if missing.is_empty() {
            attached.push(iface.name.as_str());
        } else if missing.len() == Hook::POD.len() && covered.contains(&iface.name) {
            bare_covered.push(iface.name.as_str());
        } else {
            out.push(hooks_missing(iface, &missing, globs, pin_dir));
        }
    }
    let all_attached = out.is_empty();
    out.extend(attached_summary(&attached, &bare_covered, all_attached));
    out
}

/// FAIL: no interface of this namespace matches `globs` (the first few are named).
fn no_interface_matches(interfaces: &[bpf::Interface], globs: &[String]) -> Check {
    const SHOWN: usize = 30;
    let mut seen: Vec<&str> = interfaces.iter().take(SHOWN).map(|i| i.name.as_str()).collect();
    let more = format!("and {} more", interfaces.len().saturating_sub(SHOWN));
    if interfaces.len() > SHOWN {
        seen.push(&more);
    }
    let seen = if seen.is_empty() { "none".to_owned() } else { seen.join(", ") };
    Check::fail(
        "attach",
        format!(
            "no interface matches {} in this network namespace, so no pod's traffic reaches the programs; \
             its interfaces: {seen}",
            globs.join(" ")
        ),
        "pass the pod-facing interfaces' names to the agent and to doctor with --interfaces (veth* for bridge \
         CNIs such as flannel and kindnet, cali* for Calico, lxc* for Cilium); a node that runs no pod yet has \
         none",
    )
}

/// The pod hooks `iface` has no link pin for, each described by what it does.
fn missing_hooks(iface: &bpf::Interface, links: &BTreeSet<String>) -> Vec<&'static str> {
    Hook::POD
        .iter()
        .filter(|h| !links.contains(&link_pin_name(&iface.name, iface.index, **h)))
        .map(|h| match h {
            Hook::Ingress => "ingress (DNAT of what the pod sends)",
            Hook::Egress => "egress (un-NAT of the replies it receives)",
            Hook::ExternalIngress => "external ingress (NodePort, ExternalIP and LB traffic)",
        })
        .collect()
}

/// WARN: `iface` lacks the `missing` hooks.
fn hooks_missing(iface: &bpf::Interface, missing: &[&str], globs: &[String], pin_dir: &Path) -> Check {
    Check::warn(
        format!("attach {}", iface.name),
        format!(
            "{} (index {}) has no {} program: no link pin under {}/links",
            iface.name,
            iface.index,
            missing.join(" and no "),
            pin_dir.display()
        ),
        format!(
            "the agent attaches new interfaces within --poll-ms; check its log, or run `kproxy --pin-dir {} load --interfaces {}`",
            pin_dir.display(),
            globs.join(" ")
        ),
    )
}

/// OK: the interfaces with every hook (named when none lacks one), and those the socket hooks cover.
fn attached_summary(attached: &[&str], bare_covered: &[&str], all_attached: bool) -> Option<Check> {
    let mut parts = Vec::new();
    if all_attached && !attached.is_empty() {
        parts.push(format!(
            "ingress and egress programs attached on {} interfaces: {}",
            attached.len(),
            attached.join(", ")
        ));
    }
    if !bare_covered.is_empty() {
        parts.push(format!(
            "{} covered by the socket hooks: no per-packet program needed",
            bare_covered.join(", ")
        ));
    }
    (!parts.is_empty()).then(|| Check::ok("attach", parts.join("; ")))
}

/// Fill of one map: hash maps refuse inserts when full; LRU maps evict.
pub fn map_fill_check(map: &str, entries: u64, capacity: u64) -> Check {
    let lru = matches!(map, "conntrack_v4" | "affinity_v4");
    let name = if map == "conntrack_v4" { "conntrack fill".to_owned() } else { format!("map {map}") };
    if capacity == 0 {
        return Check::warn(
            name,
            format!("{map}: cannot read its capacity ({entries} entries)"),
            "check `bpftool map show`",
        );
    }
    let percent = entries as f64 * 100.0 / capacity as f64;
    let fill = format!("{entries}/{capacity} entries ({percent:.1} %)");
    if lru {
        if percent >= 90.0 {
            let what = if entries >= capacity { "full" } else { "nearly full" };
            return Check::warn(
                name,
                format!(
                    "{map} {fill} is {what}: the LRU evicts the least recently used entries (live flows may lose their translation)"
                ),
                if map == "conntrack_v4" {
                    "raise `kproxy agent --conntrack-max` (takes effect when the datapath is loaded anew) or lower the conntrack timeouts"
                } else {
                    "lower the sessionAffinity timeouts, or reload the datapath with a larger affinity map"
                },
            );
        }
        return Check::ok(name, format!("{map} {fill} (LRU)"));
    }
    if entries >= capacity {
        Check::fail(
            name,
            format!("{map} {fill} is full: inserts fail, new Services and endpoints are not programmed"),
            "remove unused Services, or reload the datapath with larger maps (`kproxy unload`, then start the agent)",
        )
    } else if percent > 80.0 {
        Check::warn(
            name,
            format!("{map} {fill} is over 80 % full: inserts fail when it is full"),
            "plan larger maps before the cluster grows further",
        )
    } else {
        Check::ok(name, format!("{map} {fill}"))
    }
}

pub(super) fn datapath_checks(pins: &PinDir, selector: &InterfaceSelector, globs: &[String]) -> Vec<Check> {
    let root = pins.root();
    if !pins.is_loaded() {
        let what = if root.exists() {
            format!("the datapath under {} is incomplete (programs or maps missing)", root.display())
        } else {
            format!(
                "kproxy is not loaded: nothing pinned under {}; Service traffic is not translated",
                root.display()
            )
        };
        return vec![Check::fail(
            "datapath",
            what,
            format!(
                "start `kproxy agent` (it loads the datapath), or run `kproxy --pin-dir {} load`",
                root.display()
            ),
        )];
    }
    let holder = match bpf::pin_lock_pid(root) {
        Some(_) => format!("; held by {}", bpf::lock_holder(root)),
        None => String::new(),
    };
    let mut out =
        vec![Check::ok("datapath", format!("programs and maps pinned under {}{holder}", root.display()))];
    let links: BTreeSet<String> = fs::read_dir(root.join("links"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    let maps = bpf::Maps::from_pins(pins);
    let mode = maps.as_ref().ok().and_then(|m| m.socket_lb_config.get(&0, 0).ok()).map(|c| c.mode);
    match bpf::interfaces() {
        Ok(interfaces) => {
            let covered = covered_interfaces(&interfaces, selector, &covering_cgroups(&links, mode));
            out.extend(attach_checks(&interfaces, selector, globs, &links, &covered, root))
        }
        Err(e) => {
            out.push(Check::warn("attach", format!("cannot list interfaces: {e:#}"), "check `ip link`"))
        }
    }
    out.push(north_south_check(&links));
    match maps {
        Ok(maps) => {
            out.push(socket_lb_check(&links, mode));
            for (map, entries, capacity) in bpf::map_usage(&maps) {
                out.push(map_fill_check(map, entries, capacity));
            }
        }
        Err(e) => out.push(Check::fail(
            "maps",
            format!("cannot open the pinned maps: {e:#}"),
            "run `kproxy unload` and start the agent again",
        )),
    }
    out
}

/// The matching interfaces whose pods the hooks on `cgroups` cover, as the agent decides it. An
/// error reading the processes leaves them uncovered: their missing programs stay a WARN.
fn covered_interfaces(
    interfaces: &[bpf::Interface],
    selector: &InterfaceSelector,
    cgroups: &BTreeSet<PathBuf>,
) -> BTreeSet<String> {
    let names: Vec<String> =
        interfaces.iter().filter(|i| selector.matches(&i.name)).map(|i| i.name.clone()).collect();
    cgroups.iter().filter_map(|cgroup| Coverage::of_cgroup(cgroup).covered(&names).ok()).flatten().collect()
}

/// What serves traffic from outside, from the link pins: external interfaces (tc, XDP).
/// Informational: a node may well have none.
pub fn north_south_check(links: &BTreeSet<String>) -> Check {
    let interface = |l: &str| l.split('@').next().unwrap_or(l).replace("%2E", ".");
    let external: Vec<String> =
        links.iter().filter(|l| l.ends_with("-external")).map(|l| interface(l)).collect();
    let xdp: Vec<String> = links.iter().filter(|l| l.ends_with("-xdp")).map(|l| interface(l)).collect();
    let mut parts = Vec::new();
    if external.is_empty() {
        parts.push(
            "no external interface (NodePorts, ExternalIPs and LB IPs are not served on this node)"
                .to_owned(),
        );
    } else {
        parts.push(format!(
            "external interfaces {} (XDP on {})",
            external.join(", "),
            if xdp.is_empty() { "none".to_owned() } else { xdp.join(", ") }
        ));
    }
    Check::ok("north-south", parts.join("; "))
}

/// The socket hooks (link pins) and the mode the agent wrote (`SOCKET_LB_CONFIG`). Without
/// them the node's own processes — hostNetwork pods, the kubelet, node daemons — cannot reach
/// a cluster IP: their packets never cross the pods' interfaces, where the tc programs sit
/// (kube-proxy serves them in nat OUTPUT).
pub fn socket_lb_check(links: &BTreeSet<String>, mode: Option<u32>) -> Check {
    use proxy_common::maps::{SOCKET_LB_ALL, SOCKET_LB_HOST_ONLY, SOCKET_LB_OFF};
    let hooks = links.iter().filter(|l| l.starts_with("cgroup@")).count();
    match mode {
        _ if hooks == 0 => Check::warn(
            "socket-lb",
            "socket-level load balancing off: processes in the node's network namespace (hostNetwork pods, \
             kubelet) cannot reach cluster IPs",
            "run `kproxy agent` with --socket-lb host-only (the default) or on",
        ),
        Some(SOCKET_LB_OFF) => Check::warn(
            "socket-lb",
            format!(
                "socket-level load balancing off, yet {hooks} cgroup hooks are pinned: processes in the node's \
                 network namespace cannot reach cluster IPs"
            ),
            "restart `kproxy agent` with --socket-lb host-only (the default) or on",
        ),
        Some(SOCKET_LB_HOST_ONLY) => Check::ok(
            "socket-lb",
            format!(
                "socket-level load balancing host-only ({hooks} cgroup hooks): the node's own processes reach \
                 cluster IPs at connect()/sendmsg(), pods through tc"
            ),
        ),
        Some(SOCKET_LB_ALL) => Check::ok(
            "socket-lb",
            format!(
                "socket-level load balancing on ({hooks} cgroup hooks): every process's sockets are translated"
            ),
        ),
        _ => Check::ok("socket-lb", format!("{hooks} cgroup hooks pinned (mode unknown)")),
    }
}
