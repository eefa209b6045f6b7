//! sysctl checks: IPv4 and IPv6 forwarding, rp_filter and the SNAT port range, at runtime and as the sysctl.d
//! files would set them at boot.

use std::{
    fs,
    path::{Path, PathBuf},
};

use super::{Check, Status, host, read};

/// The node's ephemeral ports against the SNAT range: kproxy takes SNAT and
/// remapped ports from it without knowing the node's own sockets, so a node
/// process that picks one of them as its ephemeral port to the same backend
/// would share a reply tuple with a translated flow.
pub fn snat_ports_check(local: Runtime, reserved: Runtime, snat: (u16, u16)) -> Check {
    let name = "snat-ports";
    let Runtime::Value(local) = local else {
        return Check::ok(name, format!("SNAT ports {}-{} (ephemeral range not readable)", snat.0, snat.1));
    };
    let mut bounds = local.split_whitespace().filter_map(|v| v.parse::<u32>().ok());
    let (Some(low), Some(high)) = (bounds.next(), bounds.next()) else {
        return Check::ok(
            name,
            format!("SNAT ports {}-{} (ephemeral range {local:?} not understood)", snat.0, snat.1),
        );
    };
    let (snat_low, snat_high) = (u32::from(snat.0), u32::from(snat.1));
    let overlap_low = low.max(snat_low);
    let overlap_high = high.min(snat_high);
    if overlap_low > overlap_high {
        return Check::ok(
            name,
            format!("ephemeral ports {low}-{high} stay clear of the SNAT range {snat_low}-{snat_high}"),
        );
    }
    let reserved = match &reserved {
        Runtime::Value(v) => v.clone(),
        Runtime::Unknown(_) => String::new(),
    };
    let covered = reserved.split(',').any(|part| {
        let mut ends = part.trim().split('-').filter_map(|v| v.parse::<u32>().ok());
        match (ends.next(), ends.next()) {
            (Some(a), Some(b)) => a <= overlap_low && b >= overlap_high,
            (Some(a), None) => a == overlap_low && a == overlap_high,
            _ => false,
        }
    });
    if covered {
        return Check::ok(
            name,
            format!(
                "ephemeral ports {low}-{high} overlap the SNAT range, but ip_local_reserved_ports excludes it"
            ),
        );
    }
    Check::warn(
        name,
        format!(
            "ephemeral ports {low}-{high} overlap the SNAT range {snat_low}-{snat_high} \
             ({overlap_low}-{overlap_high}): a node process may pick a port a translated flow holds"
        ),
        format!(
            "sysctl net.ipv4.ip_local_reserved_ports={overlap_low}-{overlap_high}, or move --snat-port-range \
             outside net.ipv4.ip_local_port_range"
        ),
    )
}

/// One `key = value` line of a sysctl.d file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// Dotted form (`net.ipv4.ip_forward`), without the `-` prefix.
    pub key: String,
    pub value: String,
    /// 1-based.
    pub line: usize,
}

/// `net/ipv4/ip_forward` → `net.ipv4.ip_forward`: with `/` as the first
/// separator, slashes separate and dots are literal (sysctl.d(5)).
pub fn normalize_key(key: &str) -> String {
    let key = key.trim();
    match key.find(['.', '/']) {
        Some(i) if key.as_bytes()[i] == b'/' => key
            .chars()
            .map(|c| match c {
                '/' => '.',
                '.' => '/',
                c => c,
            })
            .collect(),
        _ => key.to_owned(),
    }
}

/// The assignments of a sysctl.d file: `#` and `;` comments, blank lines,
/// whitespace around key and value, a `-` prefix (ignore failures).
pub fn parse_sysctl(text: &str) -> Vec<Assignment> {
    text.lines()
        .enumerate()
        .filter_map(|(i, line)| {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
                return None;
            }
            let (key, value) = line.split_once('=')?;
            let key = key.trim();
            let key = key.strip_prefix('-').unwrap_or(key);
            Some(Assignment { key: normalize_key(key), value: value.trim().to_owned(), line: i + 1 })
        })
        .collect()
}

/// Directories of sysctl.d files, highest precedence first: a file name in
/// an earlier directory masks the same name in later ones.
pub const SYSCTL_DIRS: [&str; 5] =
    ["/etc/sysctl.d", "/run/sysctl.d", "/usr/local/lib/sysctl.d", "/usr/lib/sysctl.d", "/lib/sysctl.d"];

/// The order files are applied in: each `*.conf` name once (from the first
/// directory that has it), sorted by name; `/etc/sysctl.conf` last (procps'
/// `sysctl --system`). Input: (directory, file names) in [`SYSCTL_DIRS`] order.
pub fn sysctl_order(listing: &[(&str, Vec<String>)]) -> Vec<String> {
    let mut chosen: std::collections::BTreeMap<&str, String> = std::collections::BTreeMap::new();
    for (dir, names) in listing {
        for name in names.iter().filter(|n| n.ends_with(".conf")) {
            chosen.entry(name.as_str()).or_insert_with(|| format!("{dir}/{name}"));
        }
    }
    let mut files: Vec<String> = chosen.into_values().collect();
    files.push("/etc/sysctl.conf".to_owned());
    files
}

/// Where a persisted value comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The file as the node sees it (`/etc/sysctl.d/99-sysctl.conf`).
    pub file: String,
    pub line: usize,
    pub value: String,
    /// The line is a glob (`net.ipv4.conf.*.rp_filter`).
    pub glob: Option<String>,
}

impl Setting {
    pub fn location(&self) -> String {
        format!("{}:{}", self.file, self.line)
    }
}

/// The sysctl files that apply at boot, in order, with their contents.
#[derive(Clone, Debug, Default)]
pub struct SysctlFiles {
    pub files: Vec<(String, Vec<Assignment>)>,
}

impl SysctlFiles {
    pub fn read(root: Option<&Path>) -> Self {
        let listing: Vec<(&str, Vec<String>)> = SYSCTL_DIRS
            .iter()
            .map(|dir| {
                let names = fs::read_dir(host(root, dir))
                    .into_iter()
                    .flatten()
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect();
                (*dir, names)
            })
            .collect();
        let files = sysctl_order(&listing)
            .into_iter()
            .map(|file| {
                let text = read_in_root(root, &file).unwrap_or_default();
                let assignments = parse_sysctl(&text);
                (file, assignments)
            })
            .collect();
        Self { files }
    }

    /// The value `key` gets at boot: the last explicit assignment, else the
    /// last glob that matches (systemd-sysctl does not apply a glob to a key
    /// set explicitly).
    pub fn effective(&self, key: &str) -> Option<Setting> {
        let mut explicit = None;
        let mut globbed = None;
        for (file, assignments) in &self.files {
            for a in assignments {
                let setting =
                    || Setting { file: file.clone(), line: a.line, value: a.value.clone(), glob: None };
                if a.key == key {
                    explicit = Some(setting());
                } else if a.key.contains(['*', '?', '['])
                    && glob::Pattern::new(&a.key).is_ok_and(|p| p.matches(key))
                {
                    globbed = Some(Setting { glob: Some(a.key.clone()), ..setting() });
                }
            }
        }
        explicit.or(globbed)
    }
}

/// Reads `path` (absolute, as the node sees it) under `root`, following
/// symlinks inside the root (Debian's /etc/sysctl.d/99-sysctl.conf →
/// ../sysctl.conf); a link to /dev/null masks (empty).
pub(super) fn read_in_root(root: Option<&Path>, path: &str) -> Option<String> {
    let mut current = PathBuf::from(path);
    for _ in 0..8 {
        if current == Path::new("/dev/null") {
            return Some(String::new());
        }
        let on_disk = host(root, &current.to_string_lossy());
        match fs::read_link(&on_disk) {
            Ok(target) => {
                current = if target.is_absolute() {
                    target
                } else {
                    normalize(&current.parent().unwrap_or(Path::new("/")).join(target))
                };
            }
            Err(_) => return read(&on_disk),
        }
    }
    None
}

/// Resolves `.` and `..` lexically (never above `/`).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::Normal(p) => out.push(p),
            _ => {}
        }
    }
    out
}

/// A value at runtime, or why it is unknown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Runtime {
    Value(String),
    Unknown(String),
}

pub(super) fn runtime_sysctl(root: Option<&Path>, key: &str) -> Runtime {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    match read(&host(root, &path)) {
        Some(v) => Runtime::Value(v.trim().to_owned()),
        None if root.is_some() => Runtime::Unknown("cannot read runtime value under --root".to_owned()),
        None => Runtime::Unknown(format!("cannot read {path}")),
    }
}

fn describe(setting: &Setting, key: &str) -> String {
    match &setting.glob {
        Some(glob) => format!("{} sets {glob} = {} (matches {key})", setting.location(), setting.value),
        None => format!("{} sets {key} = {}", setting.location(), setting.value),
    }
}

/// A forwarding switch checked like `ip_forward`: its key, the check's name, and the words of its
/// findings and fixes.
struct Forwarding {
    name: &'static str,
    key: &'static str,
    /// What the node no longer routes when the switch is off.
    traffic: &'static str,
    /// The file to write when no sysctl file sets the key.
    new_file: &'static str,
    /// Said after every fix.
    caveat: &'static str,
}

const IPV4_FORWARDING: Forwarding = Forwarding {
    name: "ip_forward",
    key: "net.ipv4.ip_forward",
    traffic: "pod traffic",
    new_file: "/etc/sysctl.d/99-zz-kproxy.conf",
    caveat: "",
};

/// `all` is the switch the kernel's IPv6 forwarding path reads (`ip6_forward`); `default` only seeds
/// interfaces created later. Forwarding makes the kernel ignore router advertisements on
/// interfaces with `accept_ra = 1`, which the fix says, as a node taking its address from SLAAC
/// would lose it at the next lifetime expiry.
const IPV6_FORWARDING: Forwarding = Forwarding {
    name: "ipv6_forward",
    key: "net.ipv6.conf.all.forwarding",
    traffic: "IPv6 pod traffic",
    new_file: "/etc/sysctl.d/99-zz-kproxy-ipv6.conf",
    caveat: " (a node that takes its IPv6 address or default route from router advertisements also needs \
             net.ipv6.conf.<uplink>.accept_ra = 2: with forwarding on, accept_ra = 1 ignores them)",
};

/// ip_forward at runtime and after the next boot.
pub fn ip_forward_check(runtime: Runtime, persisted: Option<Setting>) -> Check {
    forwarding_check(&IPV4_FORWARDING, runtime, persisted)
}

/// Why IPv6 forwarding matters on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ipv6Need {
    /// The datapath holds this many IPv6 frontends: their pods' traffic is routed by the node.
    Services(u64),
    /// No IPv6 Service, but forwarding is on at runtime or in a sysctl file: the node is meant to
    /// route IPv6 (a dual-stack CNI, an operator), so the two disagreeing is the same drift as
    /// ip_forward's.
    Configured,
}

/// Whether `net.ipv6.conf.all.forwarding` is checked, and why. Not merely because IPv6 is
/// enabled: every Linux node has it (link-local addresses) whatever its cluster, and an IPv4-only
/// cluster never needs IPv6 forwarding — kube-proxy does not touch it, kubeadm's preflight checks
/// it only for a cluster configured with IPv6 ranges, and Cilium sets it only with `enable-ipv6` —
/// so a check on every IPv6-capable node would warn on every IPv4 one. IPv6 Services programmed
/// here, or forwarding turned on somewhere, is what makes a node a dual-stack (or IPv6) one.
pub fn ipv6_forward_need(
    ipv6_frontends: u64,
    runtime: &Runtime,
    persisted: Option<&Setting>,
) -> Option<Ipv6Need> {
    if ipv6_frontends > 0 {
        return Some(Ipv6Need::Services(ipv6_frontends));
    }
    let on_at_runtime = matches!(runtime, Runtime::Value(v) if v != "0");
    let on_at_boot = persisted.is_some_and(|s| s.value != "0");
    (on_at_runtime || on_at_boot).then_some(Ipv6Need::Configured)
}

/// `net.ipv6.conf.all.forwarding` at runtime and after the next boot, as [`ip_forward_check`], for a
/// node that needs it ([`ipv6_forward_need`]). Off at runtime with no IPv6 Service programmed is a
/// WARN, not a FAIL: nothing kproxy serves depends on it yet.
pub fn ipv6_forward_check(need: Ipv6Need, runtime: Runtime, persisted: Option<Setting>) -> Check {
    let mut check = forwarding_check(&IPV6_FORWARDING, runtime, persisted);
    match need {
        Ipv6Need::Services(n) if check.status != Status::Ok => {
            check.finding.push_str(&format!("; {n} IPv6 frontends are programmed"));
        }
        Ipv6Need::Configured if check.status == Status::Fail => check.status = Status::Warn,
        _ => {}
    }
    check
}

fn forwarding_check(switch: &Forwarding, runtime: Runtime, persisted: Option<Setting>) -> Check {
    let Forwarding { name, key, traffic, new_file, caveat } = *switch;
    let persisted_off = persisted.as_ref().filter(|s| s.value == "0");
    let file_fix = |s: &Setting| {
        format!(
            "edit {} line {} to `{key} = 1` (or delete it and set it in a later file), then `sysctl --system`{caveat}",
            s.file, s.line
        )
    };
    let new_file_fix = format!("echo '{key} = 1' > {new_file} (a file read after the others){caveat}");
    match runtime {
        Runtime::Value(v) if v == "0" => {
            let boot = match &persisted {
                Some(s) => describe(s, key),
                None => "no sysctl file sets it".to_owned(),
            };
            let fix = match persisted_off {
                Some(s) => format!("sysctl -w {key}=1; then {}", file_fix(s)),
                None if persisted.is_none() => format!("sysctl -w {key}=1; then {new_file_fix}"),
                None => format!("sysctl -w {key}=1{caveat}"),
            };
            Check::fail(name, format!("{key} = 0 at runtime: the node routes no {traffic} ({boot})"), fix)
        }
        Runtime::Value(v) => match &persisted {
            Some(s) if s.value == "0" => Check::warn(
                name,
                format!(
                    "{}: the next reboot disables forwarding (the incident of cases/001); {v} at runtime only",
                    describe(s, key)
                ),
                file_fix(s),
            ),
            Some(s) => {
                Check::ok(name, format!("{v} at runtime; {} keeps it after a reboot", describe(s, key)))
            }
            None => Check::warn(
                name,
                format!(
                    "{v} at runtime, but no sysctl file sets {key}: after a reboot it is 0 (the kernel default) until something sets it again"
                ),
                new_file_fix,
            ),
        },
        Runtime::Unknown(why) => match &persisted {
            Some(s) if s.value == "0" => Check::warn(
                name,
                format!(
                    "{why}; {}: the next boot disables forwarding (the incident of cases/001)",
                    describe(s, key)
                ),
                file_fix(s),
            ),
            Some(s) => Check::warn(
                name,
                format!("{why}; {} at boot", describe(s, key)),
                "check the running node with `kproxy doctor`",
            ),
            None => Check::warn(
                name,
                format!("{why}; no sysctl file sets {key}: it boots as 0 (the kernel default)"),
                new_file_fix,
            ),
        },
    }
}

/// rp_filter of `all` and `default`: strict (1) drops replies that arrive on
/// another interface than the route back to their source.
pub fn rp_filter_check(values: [(&str, Runtime, Option<Setting>); 2]) -> Check {
    let mut strict = Vec::new();
    let mut notes = Vec::new();
    let mut unknown = Vec::new();
    for (which, runtime, persisted) in &values {
        let key = format!("net.ipv4.conf.{which}.rp_filter");
        let boot = persisted.as_ref().map(|s| s.value.as_str());
        match runtime {
            Runtime::Value(v) => {
                if v == "1" {
                    strict.push(format!("{key} = 1 at runtime"));
                } else {
                    notes.push(format!("{which} = {v}"));
                }
                if boot == Some("1") && v != "1" {
                    strict.push(format!(
                        "{} (after the next reboot)",
                        describe(persisted.as_ref().expect("set"), &key)
                    ));
                }
            }
            Runtime::Unknown(why) => match persisted {
                Some(s) if s.value == "1" => strict.push(format!("{} (at boot)", describe(s, &key))),
                Some(s) => notes.push(format!("{which} = {} at boot", s.value)),
                None => {
                    unknown.push(why.clone());
                    notes.push(format!("{which} = 0 at boot (kernel default)"));
                }
            },
        }
    }
    if !strict.is_empty() {
        return Check::warn(
            "rp_filter",
            format!(
                "strict reverse-path filtering: {}; replies arriving through another interface than the route back to their source are dropped (kproxy's bounce paths do not need it, multi-homed nodes do)",
                strict.join("; ")
            ),
            "set net.ipv4.conf.all.rp_filter = 2 and net.ipv4.conf.default.rp_filter = 2 (loose) in /etc/sysctl.d/, then `sysctl --system`",
        );
    }
    let mut finding = format!("not strict ({})", notes.join(", "));
    if let Some(why) = unknown.first() {
        finding.push_str(&format!("; {why}"));
    }
    Check::ok("rp_filter", finding)
}
