//! The `process_*` families every Prometheus client's process collector exports, under client_golang's names
//! and help texts, read from `/proc/self` at scrape time.

use super::exposition::{format_float, scalars};

pub(super) const PROCESS_CPU: &str = "process_cpu_seconds_total";
pub(super) const PROCESS_RESIDENT: &str = "process_resident_memory_bytes";
pub(super) const PROCESS_VIRTUAL: &str = "process_virtual_memory_bytes";
pub(super) const PROCESS_VIRTUAL_MAX: &str = "process_virtual_memory_max_bytes";
pub(super) const PROCESS_START: &str = "process_start_time_seconds";
pub(super) const PROCESS_OPEN_FDS: &str = "process_open_fds";
pub(super) const PROCESS_MAX_FDS: &str = "process_max_fds";

/// What the process collectors of the Prometheus client libraries report, read
/// from `/proc/self` at scrape time. A value that cannot be read is left out.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: Option<f64>,
    pub resident_bytes: Option<u64>,
    pub virtual_bytes: Option<u64>,
    /// `RLIMIT_AS`; `u64::MAX` when unlimited, as client_golang reports it.
    pub virtual_max_bytes: Option<u64>,
    pub start_time_seconds: Option<f64>,
    pub open_fds: Option<u64>,
    /// `RLIMIT_NOFILE`'s soft limit.
    pub max_fds: Option<u64>,
}

impl ProcessStats {
    /// This process, now.
    pub fn read() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        // SAFETY: sysconf takes no pointer and only reads configuration.
        let (ticks, page_size) =
            unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
        let boot_time = read("/proc/stat").as_deref().and_then(boot_time_seconds);
        let mut stats = match read("/proc/self/stat") {
            Some(stat) if ticks > 0 && page_size > 0 => {
                parse_stat(&stat, ticks as f64, page_size as u64, boot_time).unwrap_or_default()
            }
            _ => ProcessStats::default(),
        };
        if let Some(limits) = read("/proc/self/limits") {
            stats.max_fds = limit(&limits, "Max open files");
            stats.virtual_max_bytes = limit(&limits, "Max address space");
        }
        stats.open_fds = std::fs::read_dir("/proc/self/fd").ok().map(|dir| dir.count() as u64);
        stats
    }
}

/// CPU time, memory and start time from `/proc/<pid>/stat`: `comm` (field 2) may
/// hold spaces and parentheses, so fields are counted from its closing `)`.
fn parse_stat(
    stat: &str,
    ticks_per_second: f64,
    page_size: u64,
    boot_time: Option<f64>,
) -> Option<ProcessStats> {
    let (_, rest) = stat.rsplit_once(')')?;
    // rest[0] is field 3 (state); field N is rest[N - 3].
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let (utime, stime) = (field(14)?, field(15)?);
    Some(ProcessStats {
        cpu_seconds: Some((utime + stime) as f64 / ticks_per_second),
        start_time_seconds: boot_time
            .zip(field(22))
            .map(|(boot, start_ticks)| boot + start_ticks as f64 / ticks_per_second),
        virtual_bytes: field(23),
        resident_bytes: field(24).map(|pages| pages.saturating_mul(page_size)),
        ..ProcessStats::default()
    })
}

/// `btime` of `/proc/stat`: when the machine booted, in seconds since the epoch.
fn boot_time_seconds(proc_stat: &str) -> Option<f64> {
    proc_stat.lines().find_map(|line| line.strip_prefix("btime ")?.trim().parse().ok())
}

/// The soft limit named `name` in `/proc/<pid>/limits`; `unlimited` is `u64::MAX`.
fn limit(limits: &str, name: &str) -> Option<u64> {
    let rest = limits.lines().find_map(|line| line.strip_prefix(name))?;
    match rest.split_whitespace().next()? {
        "unlimited" => Some(u64::MAX),
        soft => soft.parse().ok(),
    }
}

/// The `process_*` families; a value that could not be read is left out with its family.
pub(super) fn render(out: &mut String, stats: &ProcessStats) {
    let families: [(&str, &str, &str, Option<String>); 7] = [
        (
            PROCESS_CPU,
            "Total user and system CPU time spent in seconds.",
            "counter",
            stats.cpu_seconds.map(format_float),
        ),
        (
            PROCESS_OPEN_FDS,
            "Number of open file descriptors.",
            "gauge",
            stats.open_fds.map(|v| v.to_string()),
        ),
        (
            PROCESS_MAX_FDS,
            "Maximum number of open file descriptors.",
            "gauge",
            stats.max_fds.map(|v| format_float(v as f64)),
        ),
        (
            PROCESS_VIRTUAL,
            "Virtual memory size in bytes.",
            "gauge",
            stats.virtual_bytes.map(|v| v.to_string()),
        ),
        (
            PROCESS_VIRTUAL_MAX,
            "Maximum amount of virtual memory available in bytes.",
            "gauge",
            stats.virtual_max_bytes.map(|v| format_float(v as f64)),
        ),
        (
            PROCESS_RESIDENT,
            "Resident memory size in bytes.",
            "gauge",
            stats.resident_bytes.map(|v| v.to_string()),
        ),
        (
            PROCESS_START,
            "Start time of the process since unix epoch in seconds.",
            "gauge",
            stats.start_time_seconds.map(format_float),
        ),
    ];
    scalars(
        out,
        families.into_iter().filter_map(|(name, help, kind, value)| Some((name, help, kind, value?))),
    );
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::super::tests::parse;
    use super::super::{Metrics, unix_seconds};
    use super::*;

    #[test]
    fn process_stats_from_proc() {
        // A comm with spaces and parentheses; fields as proc(5) numbers them.
        let stat = "4242 (kproxy (a) b) S 1 4242 4242 0 -1 4194560 900 0 0 0 \
                    250 130 0 0 20 0 3 0 1234500 987654321 2048 18446744073709551615 0 0";
        let stats = parse_stat(stat, 100.0, 4096, Some(1_700_000_000.0)).unwrap();
        assert_eq!(stats.cpu_seconds, Some(3.8));
        assert_eq!(stats.start_time_seconds, Some(1_700_012_345.0));
        assert_eq!(stats.virtual_bytes, Some(987_654_321));
        assert_eq!(stats.resident_bytes, Some(2048 * 4096));
        assert_eq!(parse_stat("4242 (truncated", 100.0, 4096, None), None);

        assert_eq!(boot_time_seconds("cpu  1 2 3\nbtime 1700000000\nprocesses 7\n"), Some(1_700_000_000.0));
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max address space         unlimited            unlimited            bytes     \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(limit(limits, "Max open files"), Some(1024));
        assert_eq!(limit(limits, "Max address space"), Some(u64::MAX));

        // This test process, read for real.
        let live = ProcessStats::read();
        let now = unix_seconds(SystemTime::now());
        let started = live.start_time_seconds.expect("start time");
        assert!(started <= now + 1.0 && started > now - 86_400.0 * 365.0, "{started} vs {now}");
        assert!(
            live.resident_bytes.unwrap() > 0 && live.virtual_bytes.unwrap() >= live.resident_bytes.unwrap()
        );
        assert!(live.open_fds.unwrap() >= 3 && live.max_fds.unwrap() >= live.open_fds.unwrap());
        assert!(live.cpu_seconds.unwrap() >= 0.0);
        let exp = parse(&Metrics::new().render());
        assert!(exp.value(PROCESS_RESIDENT, &[]).unwrap().parse::<u64>().unwrap() > 0);
    }
}
