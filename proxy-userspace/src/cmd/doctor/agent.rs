//! The agent's check: its /healthz answer.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream, ToSocketAddrs as _},
    time::Duration,
};

use super::Check;

/// The status code of `GET /healthz` (HTTP/1.0, 2 s timeouts) and the body.
fn http_get(address: &str, path: &str) -> std::io::Result<(u16, String)> {
    let addr: SocketAddr = match address.parse() {
        Ok(addr) => addr,
        Err(_) => address.to_socket_addrs()?.next().ok_or_else(|| std::io::Error::other("no address"))?,
    };
    let timeout = Duration::from_secs(2);
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\nConnection: close\r\n\r\n")?;
    let mut response = Vec::new();
    stream.take(64 * 1024).read_to_end(&mut response)?;
    parse_http_response(&String::from_utf8_lossy(&response))
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP response"))
}

/// `HTTP/1.1 200 OK\r\n...\r\n\r\nbody` → (200, body).
pub fn parse_http_response(text: &str) -> Option<(u16, String)> {
    let status_line = text.lines().next()?;
    let mut fields = status_line.split_whitespace();
    if !fields.next()?.starts_with("HTTP/") {
        return None;
    }
    let code = fields.next()?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Some((code, body.trim().to_owned()))
}

pub fn agent_verdict(address: &str, result: &std::io::Result<(u16, String)>) -> Check {
    match result {
        Ok((200, body)) => Check::ok("agent", format!("healthy: GET http://{address}/healthz → 200 {body}")),
        Ok((503, body)) => Check::fail(
            "agent",
            format!(
                "unhealthy: GET http://{address}/healthz → 503 {body}: a change has waited over 2 × --sync-period, the maps lag the cluster"
            ),
            "read the agent's log (sync errors, API server access); restart it if it is stuck",
        ),
        Ok((code, body)) => Check::warn(
            "agent",
            format!("GET http://{address}/healthz → {code} {body}: is this kproxy's health server?"),
            "check --healthz-bind-address of the agent and --healthz-address",
        ),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Check::warn(
            "agent",
            format!("no agent is running: connection refused on {address}"),
            "start `kproxy agent` (the DaemonSet); without it the maps stop following the cluster",
        ),
        Err(e) => Check::warn(
            "agent",
            format!("cannot reach http://{address}/healthz: {e}"),
            "check that `kproxy agent` runs and --healthz-address matches its --healthz-bind-address",
        ),
    }
}

pub(super) fn agent_check(address: &str) -> Check {
    agent_verdict(address, &http_get(address, "/healthz"))
}
