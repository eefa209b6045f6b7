//! The `kproxy` agent and operator commands.

pub mod agent;
pub mod cleanup;
pub mod datapath;
pub mod diff;
pub mod doctor;
pub mod dump;
pub mod gc;
pub mod health;
pub mod kube_proxy_config;
pub mod last_good;
pub mod manifest;
pub mod manifest_watch;
pub mod metrics;
pub mod model;
pub mod model_cache;
pub mod nodeport;
pub mod service_health;
pub mod sockdiag;
pub mod source;
pub mod sync;
pub mod trace;

#[cfg(test)]
mod deploy_manifests;
#[cfg(test)]
mod mem_store;
#[cfg(test)]
mod test_http;
