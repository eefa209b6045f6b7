//! A minimal HTTP/1.1 client for tests of the agent's HTTP endpoints. It is
//! hand-rolled so that tests see the bytes a real client would (status line,
//! headers, exact body) and can keep one connection open across requests.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// One request on a fresh connection that is closed afterwards.
pub async fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    let mut connection = Connection::open(addr).await;
    connection.send(addr, path, "close").await;
    connection.response().await.expect("a response before the connection closed")
}

/// A keep-alive connection, to tell a server that kept running from one that
/// was restarted (which would have closed the connection).
pub struct Connection {
    stream: BufReader<TcpStream>,
    addr: SocketAddr,
}

impl Connection {
    pub async fn open(addr: SocketAddr) -> Self {
        Connection { stream: BufReader::new(TcpStream::connect(addr).await.unwrap()), addr }
    }

    /// GET `path` and read the answer; `None` if the server closed the
    /// connection instead of answering.
    pub async fn get(&mut self, path: &str) -> Option<HttpResponse> {
        let addr = self.addr;
        // A write to a connection the server has closed may still succeed
        // locally; the read below is what tells.
        if !self.send(addr, path, "keep-alive").await {
            return None;
        }
        self.response().await
    }

    async fn send(&mut self, addr: SocketAddr, path: &str, connection: &str) -> bool {
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: {connection}\r\n\r\n");
        self.stream.get_mut().write_all(request.as_bytes()).await.is_ok()
    }

    async fn response(&mut self) -> Option<HttpResponse> {
        tokio::time::timeout(Duration::from_secs(10), self.read_response())
            .await
            .expect("a response (or a closed connection) in time")
    }

    async fn read_response(&mut self) -> Option<HttpResponse> {
        let mut line = String::new();
        // A reset counts as closed, like a clean EOF.
        if self.stream.read_line(&mut line).await.unwrap_or(0) == 0 {
            return None;
        }
        let status = line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {line:?}"));
        let mut headers = Vec::new();
        loop {
            line.clear();
            self.stream.read_line(&mut line).await.unwrap();
            let header = line.trim_end_matches(['\r', '\n']);
            if header.is_empty() {
                break;
            }
            let (k, v) = header.split_once(':').unwrap_or_else(|| panic!("bad header {header:?}"));
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
        let mut response = HttpResponse { status, headers, body: String::new() };
        // Every endpoint under test answers with a complete body, so hyper
        // always sends its length; without it a keep-alive reader could not
        // find the end.
        let length: usize = response
            .header("content-length")
            .expect("a Content-Length header")
            .parse()
            .expect("a numeric Content-Length");
        let mut body = vec![0; length];
        self.stream.read_exact(&mut body).await.unwrap();
        response.body = String::from_utf8(body).expect("a UTF-8 body");
        Some(response)
    }
}
