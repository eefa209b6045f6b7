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

/// The `reason` of an unhealthy `/healthz` body (`{"lastUpdated": …, "reason": "…"}`), if it has one.
fn health_reason(body: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(body).ok()?;
    value.get("reason")?.as_str().map(str::to_owned)
}

/// What to do about each part of an unhealthy answer's reason (the agent joins them with "; ").
fn unhealthy_fix(reason: &str) -> String {
    let mut fixes: Vec<&str> = Vec::new();
    if reason.contains("watch:") {
        fixes.push("the agent cannot see the API server: see the api-server check and the agent's log");
    } else if reason.contains("no sync has been programmed yet") {
        fixes.push(
            "the agent has not programmed the maps once: it waits for a complete list of Services and \
             EndpointSlices (see the api-server check and the agent's log)",
        );
    }
    if reason.contains("not eligible") {
        fixes.push(
            "the Node is being deleted or tainted ToBeDeletedByClusterAutoscaler: load balancers stop \
             sending it traffic, as intended",
        );
    }
    if reason.contains("for a successful sync") {
        fixes.push("read the agent's log for sync errors; restart it if it is stuck");
    }
    if fixes.is_empty() {
        fixes.push("read the agent's log (sync errors, API server access); restart it if it is stuck");
    }
    fixes.join("; ")
}

pub fn agent_verdict(address: &str, result: &std::io::Result<(u16, String)>) -> Check {
    match result {
        Ok((200, body)) => Check::ok("agent", format!("healthy: GET http://{address}/healthz → 200 {body}")),
        Ok((503, body)) => {
            let reason = health_reason(body);
            let finding = match &reason {
                Some(reason) => format!("unhealthy: GET http://{address}/healthz → 503: {reason}"),
                // An agent from before `reason`: a change waited, the only cause then.
                None => format!(
                    "unhealthy: GET http://{address}/healthz → 503 {body}: a change has waited over \
                     2 × --sync-period, the maps lag the cluster"
                ),
            };
            Check::fail("agent", finding, unhealthy_fix(reason.as_deref().unwrap_or_default()))
        }
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
