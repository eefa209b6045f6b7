//! `kproxy trace` at the kernel boundary: the EVENTS ring buffer read event by event, the TRACE flag
//! every listening session shares, and the frontend names the events are labelled with.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result};
use aya::maps::{Array, HashMap, Map, MapData, RingBuf};
use proxy_common::{
    maps::{FrontendNameV4, MAP_FRONTEND_NAMES_V4},
    trace::{MAP_EVENTS, MAP_TRACE, TraceConfig, TraceEvent, TraceEventV4, TraceEventV6},
};
use std::net::IpAddr;

use super::{PinDir, flock, maps::open_pinned};

/// The pinned EVENTS ring buffer, read from this process's own position (see [`Listening`]).
pub struct EventRing(RingBuf<MapData>);

impl EventRing {
    pub fn open(pins: &PinDir) -> Result<Self> {
        Ok(Self(RingBuf::try_from(Map::RingBuf(open_pinned(pins, MAP_EVENTS)?))?))
    }

    /// The next event of either family, if one is waiting. Both families write to the one ring
    /// buffer and a record's length says which it is; a record of neither length is skipped.
    pub fn next_event(&mut self) -> Option<TraceEvent<IpAddr>> {
        loop {
            let item = self.0.next()?;
            if let Some(event) = decode(&item) {
                return Some(event);
            }
        }
    }
}

/// A ring buffer record as an event: [`TraceEventV4`] or [`TraceEventV6`] by its length.
pub fn decode(record: &[u8]) -> Option<TraceEvent<IpAddr>> {
    if record.len() == size_of::<TraceEventV6>() {
        // SAFETY: exactly one TraceEventV6, a repr(C) of integers and byte arrays; the read is
        // unaligned-safe.
        let event: TraceEventV6 = unsafe { std::ptr::read_unaligned(record.as_ptr().cast()) };
        Some(event.map_addrs(IpAddr::from))
    } else if record.len() == size_of::<TraceEventV4>() {
        // SAFETY: as above, for one TraceEventV4.
        let event: TraceEventV4 = unsafe { std::ptr::read_unaligned(record.as_ptr().cast()) };
        Some(event.map_addrs(IpAddr::from))
    } else {
        None
    }
}

/// Every programmed frontend's name (FRONTEND_NAMES_V4), by rev-NAT id.
pub fn frontend_names(pins: &PinDir) -> Result<BTreeMap<proxy_common::maps::RevNatId, String>> {
    let path = pins.map(MAP_FRONTEND_NAMES_V4);
    let map: HashMap<MapData, proxy_common::maps::RevNatId, FrontendNameV4> = HashMap::try_from(
        Map::HashMap(MapData::from_pin(&path).with_context(|| path.display().to_string())?),
    )?;
    Ok(map.iter().filter_map(Result::ok).map(|(id, n)| (id, n.as_str().to_owned())).collect())
}

/// The pinned TRACE flag: the datapath emits events while it is set.
pub struct TraceFlag(Array<MapData, TraceConfig>);

impl TraceFlag {
    pub fn open(pins: &PinDir) -> Result<Self> {
        Ok(Self(Array::try_from(Map::Array(open_pinned(pins, MAP_TRACE)?))?))
    }
}

/// This session's share of the TRACE flag, which every `kproxy trace` of the node sets and the
/// last one to leave clears. The sessions are counted by the kernel: each holds a shared flock
/// on the pin tree's maps directory while it listens (bpffs holds no regular files to lock),
/// and a leaving session that can turn its lock exclusive was the last. A session that dies
/// loses its lock with it, so the count never goes stale; a flag it left set is cleared by the
/// next session to leave. Each session reads the ring buffer from its own position (aya keeps
/// the consumer position in the process), so sessions side by side see the same events.
pub struct Listening {
    flag: TraceFlag,
    sessions: std::fs::File,
}

impl Listening {
    pub fn start(pins: &PinDir, mut flag: TraceFlag) -> Result<Self> {
        let dir = pins.maps_dir();
        let sessions = std::fs::File::open(&dir).with_context(|| format!("opening {}", dir.display()))?;
        // Waits only while a leaving last session clears the flag.
        flock(&sessions, libc::LOCK_SH)
            .with_context(|| format!("joining the trace sessions on {}", dir.display()))?;
        flag.0.set(0, TraceConfig { enabled: 1 }, 0).context("switching tracing on")?;
        Ok(Self { flag, sessions })
    }
}

impl Drop for Listening {
    /// Clears the flag, however tracing ends, unless another session still listens.
    fn drop(&mut self) {
        if flock(&self.sessions, libc::LOCK_EX | libc::LOCK_NB).is_ok() {
            let _ = self.flag.0.set(0, TraceConfig { enabled: 0 }, 0);
        }
    }
}
