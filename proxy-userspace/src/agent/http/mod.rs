//! The agent's HTTP endpoints: /healthz and /livez, /metrics, and the per-Service health check ports.

pub mod health;
pub(crate) mod listen;
pub mod metrics;
pub mod service_health;
