//! Real servers in pods: nginx (HTTP backends) and dnsmasq (DNS backends), each telling which
//! pod answered.
use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result};

use crate::sandbox::{Pod, Spawned};
use crate::tools::find_tool;

/// Size of the file every nginx serves at [`BIG_FILE_PATH`] (10 MiB).
pub const BIG_FILE_LEN: usize = 10 * 1024 * 1024;
/// URL path of the big file on every nginx.
pub const BIG_FILE_PATH: &str = "/big.bin";
/// The same file, sent by nginx at 1 MiB/s (`limit_rate`): a long-lived connection whose pace
/// does not depend on how the client throttles its reads.
pub const SLOW_FILE_PATH: &str = "/slow.bin";
/// How long a server may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// The deterministic content of [`BIG_FILE_PATH`] (xorshift bytes), to compare a download with.
pub fn big_file_contents() -> Vec<u8> {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut out = Vec::with_capacity(BIG_FILE_LEN);
    while out.len() < BIG_FILE_LEN {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(BIG_FILE_LEN);
    out
}

/// `ipv6`: also listen on `[::]:port` (a dual-stack pod, [`Pod::add_ipv6`]).
fn nginx_config(dir: &Path, port: u16, big_file: &Path, ipv6: bool) -> String {
    let d = dir.display();
    let big = big_file.display();
    let listen_ipv6 =
        if ipv6 { format!("listen [::]:{port} default_server ipv6only=on;") } else { String::new() };
    format!(
        r#"# kproxy test backend; everything it writes stays in {d}
daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log notice;
events {{
    worker_connections 1024;
}}
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/tmp/body;
    proxy_temp_path {d}/tmp/proxy;
    fastcgi_temp_path {d}/tmp/fastcgi;
    uwsgi_temp_path {d}/tmp/uwsgi;
    scgi_temp_path {d}/tmp/scgi;
    default_type text/plain;
    keepalive_timeout 65;
    server {{
        listen {port} default_server;
        {listen_ipv6}
        root {d}/html;
        index index.html;
        # Where the request came from, as the backend sees it (source NAT checks).
        location = /client {{
            return 200 "$remote_addr\n";
        }}
        # Which backend answered, and whom it saw: "<backend ip> <client ip>".
        location = /whoami {{
            return 200 "$server_addr $remote_addr\n";
        }}
        location = {BIG_FILE_PATH} {{
            default_type application/octet-stream;
            alias {big};
        }}
        location = {SLOW_FILE_PATH} {{
            default_type application/octet-stream;
            limit_rate 1m;
            alias {big};
        }}
    }}
}}
"#
    )
}

impl Pod {
    /// Starts downloading [`SLOW_FILE_PATH`] (10 MiB at 1 MiB/s) from `server` (an address, or
    /// `address:port`) into `out`: a connection that stays open for about ten seconds.
    pub fn download_slowly(&self, server: &str, out: &Path) -> Result<Spawned> {
        let url = format!("http://{server}{SLOW_FILE_PATH}");
        let out = out.to_string_lossy();
        self.spawn([
            "curl",
            "-sS",
            "--limit-rate",
            "1M",
            "--max-time",
            "60",
            "-o",
            out.as_ref(),
            url.as_str(),
        ])
    }

    /// nginx on 0.0.0.0:80 (and [::]:80 in a dual-stack pod) serving `body` at `/`, the pod's view of the client address at
    /// `/client`, and [`big_file_contents`] at [`BIG_FILE_PATH`]. Returns once it listens.
    pub fn start_nginx(&self, body: &str) -> Result<Spawned> {
        self.start_nginx_on(80, body)
    }

    /// Like [`Pod::start_nginx`] on another port (several may run in one pod).
    pub fn start_nginx_on(&self, port: u16, body: &str) -> Result<Spawned> {
        let nginx = find_tool("nginx")?;
        let dir = self.dir().join(format!("nginx-{port}"));
        std::fs::create_dir_all(dir.join("html"))
            .and_then(|()| std::fs::create_dir_all(dir.join("tmp")))
            .with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(dir.join("html/index.html"), body)?;
        let big = dir.join("big.bin");
        std::fs::write(&big, big_file_contents()).with_context(|| format!("writing {}", big.display()))?;
        let conf = dir.join("nginx.conf");
        std::fs::write(&conf, nginx_config(&dir, port, &big, self.ip6().is_some()))?;
        let mut args = vec![nginx.into_os_string()];
        args.extend(["-p".into(), dir.clone().into_os_string()]);
        args.extend(["-c".into(), conf.into_os_string()]);
        args.extend(["-e".into(), dir.join("error.log").into_os_string()]);
        let server = self.spawn(args)?;
        self.wait_listening("tcp", port, Some(&server), START_TIMEOUT).with_context(|| {
            format!("nginx in pod {}; error log: {}", self.name(), dir.join("error.log").display())
        })?;
        Ok(server)
    }

    /// dnsmasq on `<pod ip>:53` (UDP and TCP) answering
    /// - `web.default.svc.cluster.local` A → `answer`,
    /// - `whoami.kproxy.test` TXT → this pod's name (tells which backend answered),
    /// - `ip.kproxy.test` A → this pod's address, and in a dual-stack pod ([`Pod::add_ipv6`])
    ///   `ip6.kproxy.test` AAAA → its IPv6 address (it then listens on that address too),
    /// - `big.kproxy.test` TXT → [`BIG_TXT_STRINGS`] strings of 250 bytes, the first naming this
    ///   pod (a UDP answer of about 2 KB: fragmented on a 1500-byte MTU),
    ///
    /// and nothing else (no upstream, no /etc/hosts). Returns once it listens.
    pub fn start_dnsmasq(&self, answer: Ipv4Addr) -> Result<Spawned> {
        self.start_dnsmasq_with(answer, QueryLog::On)
    }

    /// [`Self::start_dnsmasq`], choosing whether each query is logged (benchmarks turn it
    /// off: a log line per query would be what is measured).
    pub fn start_dnsmasq_with(&self, answer: Ipv4Addr, query_log: QueryLog) -> Result<Spawned> {
        let dnsmasq = find_tool("dnsmasq")?;
        let dir = self.dir().join("dnsmasq");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut args = vec![
            dnsmasq.to_string_lossy().into_owned(),
            "--keep-in-foreground".into(),
            "--conf-file=/dev/null".into(),
            "--no-resolv".into(),
            "--no-hosts".into(),
            "--no-poll".into(),
            "--user=root".into(),
            "--port=53".into(),
            format!("--listen-address={}", self.ip()),
            "--bind-interfaces".into(),
            format!("--address=/web.default.svc.cluster.local/{answer}"),
            format!("--txt-record=whoami.kproxy.test,{}", self.name()),
            format!("--host-record=ip.kproxy.test,{}", self.ip()),
            big_txt_record(self.name()),
            // dnsmasq ≥ 2.87 reads and answers at most 1232 bytes by default.
            "--edns-packet-max=4096".into(),
            format!("--pid-file={}", dir.join("dnsmasq.pid").display()),
            format!("--log-facility={}", dir.join("dnsmasq.log").display()),
            "--cache-size=1000".into(),
        ];
        if let Some(ip6) = self.ip6() {
            // A dual-stack pod answers on its IPv6 address too, `ip.kproxy.test` AAAA being it.
            args.push(format!("--listen-address={ip6}"));
            args.push(format!("--host-record=ip6.kproxy.test,{ip6}"));
        }
        if query_log == QueryLog::On {
            args.push("--log-queries".into());
        }
        let server = self.spawn(&args)?;
        self.wait_listening("udp", 53, Some(&server), START_TIMEOUT)
            .and_then(|()| self.wait_listening("tcp", 53, Some(&server), START_TIMEOUT))
            .with_context(|| {
                format!("dnsmasq in pod {}; log: {}", self.name(), dir.join("dnsmasq.log").display())
            })?;
        Ok(server)
    }
}

/// Whether dnsmasq logs every query it answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryLog {
    On,
    Off,
}

/// How many 250-byte strings `big.kproxy.test` has.
pub const BIG_TXT_STRINGS: usize = 8;

/// `--txt-record` for `big.kproxy.test`: the pod's name padded to 250 bytes, then more strings of
/// 250 bytes.
fn big_txt_record(pod: &str) -> String {
    let mut strings = vec![format!("{pod:-<250}")];
    strings.extend((1..BIG_TXT_STRINGS).map(|i| format!("{i}").repeat(250)));
    format!("--txt-record=big.kproxy.test,{}", strings.join(","))
}

/// A Python script that sends `server:port` a TXT query for `big.kproxy.test` padded to 2 KB
/// (EDNS0 padding option; UDP payload size 4096), so that query and answer both travel in
/// fragments on a 1500-byte MTU. It prints the query's length, the answer's length, the address
/// the answer came from and the DNS pod named in it.
pub fn big_dns_query_script(server: std::net::Ipv4Addr, port: u16) -> String {
    format!(
        r#"
import socket, struct
q = struct.pack('>HHHHHH', 0x4242, 0x0100, 1, 0, 0, 1)
for label in b'big.kproxy.test'.split(b'.'):
    q += bytes([len(label)]) + label
q += b'\x00' + struct.pack('>HH', 16, 1)
padding = struct.pack('>HH', 12, 1900) + bytes(1900)
q += b'\x00' + struct.pack('>HHIH', 41, 4096, 0, len(padding)) + padding
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(3)
s.sendto(q, ('{server}', {port}))
reply, source = s.recvfrom(8192)
# Header, question, then the answer: compressed name, type, class, TTL, length, first string.
i = 12
while reply[i] != 0:
    i += reply[i] + 1
i += 1 + 4 + 2 + 2 + 2 + 4 + 2
print(len(q), len(reply), source[0], reply[i + 1:i + 1 + reply[i]].decode().rstrip('-'))
"#
    )
}
