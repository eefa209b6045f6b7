//! kube-proxy compatible health and metrics HTTP endpoints.
//!
//! * `--healthz-bind-address` (kube-proxy default `0.0.0.0:10256`): `/healthz`
//!   and `/livez`, JSON bodies, 200 when healthy and 503 when not.
//! * `--metrics-bind-address` (kube-proxy default `127.0.0.1:10249`):
//!   `/metrics` (Prometheus text format) and `/proxyMode` (`ebpf`).
//!
//! Health follows kube-proxy's proxier health server: the proxy is unhealthy
//! while a queued change has waited longer than the health timeout
//! (kube-proxy uses 2 × `--sync-period`) without a successful sync. Starting
//! up with nothing queued is healthy.
//!
//! `/healthz` (not `/livez`: restarting the agent does not bring the API server
//! back) is also 503 while the agent cannot see the cluster: a watched kind has
//! shown no progress (a complete list, an event, a bookmark or a watch the
//! server accepted) for its progress timeout, or needs a list and has failed
//! [`LIST_FAILURES_BLIND`] in a row. An unhealthy body says why in `reason`.
//!
//! Both servers answer GET and HEAD only; other methods get 405 with `Allow`.
//!
//! [`state`] holds what the answers are made of ([`Health`], the watches' progress); [`server`] binds the two
//! listeners and answers HTTP.

mod server;
mod state;

pub use server::{BIND_RETRY, Bound, PROXY_MODE, Server, bind, bind_server, serve, serve_retrying};
pub(crate) use server::{Body, Respond, accept_loop, text};
pub use state::{Health, HealthReport, LIST_FAILURES_BLIND, SourceHealth};
