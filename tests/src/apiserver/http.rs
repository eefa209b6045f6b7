//! Just enough HTTP/1.1 for the API server: request heads, JSON responses, chunked streams.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;

/// Largest request body read (and discarded).
const MAX_BODY: u64 = 1 << 20;

pub(super) struct Request {
    pub method: String,
    /// The request target as sent (`/api/v1/services?limit=500`).
    pub target: String,
    /// The percent-decoded path.
    pub path: String,
    /// Decoded query pairs, in order; empty pairs (kube-rs sends `?&watch=true`) are skipped.
    pub query: Vec<(String, String)>,
    pub keep_alive: bool,
}

impl Request {
    /// The first value of query parameter `key`.
    pub fn param(&self, key: &str) -> Option<&str> {
        self.query.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// Reads one request; `None` when the client closed the connection between requests.
pub(super) fn read_request(reader: &mut BufReader<TcpStream>) -> io::Result<Option<Request>> {
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        if !line.trim().is_empty() {
            break;
        }
    }
    let mut parts = line.split_whitespace();
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad request line {line:?}")));
    };
    let (method, target) = (method.to_string(), target.to_string());
    let mut keep_alive = version == "HTTP/1.1";
    let mut content_length = 0u64;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        let Some((name, value)) = header.split_once(':') else { continue };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => {
                content_length = value
                    .parse()
                    .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad Content-Length"))?
            }
            "connection" if value.eq_ignore_ascii_case("close") => keep_alive = false,
            "connection" if value.eq_ignore_ascii_case("keep-alive") => keep_alive = true,
            "transfer-encoding" => {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "chunked request bodies unsupported"));
            }
            _ => {}
        }
    }
    if content_length > MAX_BODY {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "request body too large"));
    }
    io::copy(&mut reader.by_ref().take(content_length), &mut io::sink())?;
    let (raw_path, raw_query) = target.split_once('?').unwrap_or((&target, ""));
    let path = percent_decode(raw_path, false);
    let query = raw_query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k, true), percent_decode(v, true))
        })
        .collect();
    Ok(Some(Request { method, target, path, query, keep_alive }))
}

/// Decodes `%XX` (and `+` as space in query strings).
pub(super) fn percent_decode(s: &str, plus_is_space: bool) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex_digit(bytes[i + 1]), hex_digit(bytes[i + 2])) {
                (Some(hi), Some(lo)) => {
                    out.push(hi << 4 | lo);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' if plus_is_space => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_digit(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

fn reason_phrase(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        410 => "Gone",
        500 => "Internal Server Error",
        _ => "Unknown",
    }
}

/// Writes a complete JSON response.
pub(super) fn write_json(
    mut out: &TcpStream,
    code: u16,
    body: &serde_json::Value,
    keep_alive: bool,
) -> io::Result<()> {
    let body = serde_json::to_vec(body).map_err(io::Error::other)?;
    let mut response = format!(
        "HTTP/1.1 {code} {}\r\nCache-Control: no-cache, private\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{}\r\n",
        reason_phrase(code),
        body.len(),
        if keep_alive { "" } else { "Connection: close\r\n" },
    )
    .into_bytes();
    response.extend_from_slice(&body);
    out.write_all(&response)
}

/// Writes the head of a `200` chunked JSON stream.
pub(super) fn write_stream_head(mut out: &TcpStream) -> io::Result<()> {
    out.write_all(
        b"HTTP/1.1 200 OK\r\nCache-Control: no-cache, private\r\nContent-Type: application/json\r\n\
          Transfer-Encoding: chunked\r\n\r\n",
    )
}

/// Writes each line as its own chunk, in one write.
pub(super) fn write_chunks(mut out: &TcpStream, lines: &[String]) -> io::Result<()> {
    if lines.is_empty() {
        return Ok(());
    }
    let mut buf = Vec::new();
    for line in lines {
        buf.extend_from_slice(format!("{:x}\r\n", line.len()).as_bytes());
        buf.extend_from_slice(line.as_bytes());
        buf.extend_from_slice(b"\r\n");
    }
    out.write_all(&buf)
}

/// Announces a chunk of `line`'s length and writes only the first half of it: a stream cut in the
/// middle of an event.
pub(super) fn write_half_chunk(mut out: &TcpStream, line: &str) -> io::Result<()> {
    let mut buf = format!("{:x}\r\n", line.len()).into_bytes();
    buf.extend_from_slice(&line.as_bytes()[..line.len() / 2]);
    out.write_all(&buf)
}

/// Ends a chunked stream cleanly.
pub(super) fn write_stream_end(mut out: &TcpStream) -> io::Result<()> {
    out.write_all(b"0\r\n\r\n")
}
