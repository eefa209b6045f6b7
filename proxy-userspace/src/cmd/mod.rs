//! Operator commands. They open the pinned maps themselves and never import the agent.

pub mod cleanup;
pub mod conntrack;
pub mod diff;
pub mod doctor;
pub mod dump;
pub mod handover;
pub mod kube_proxy_rules;
pub mod netfilter;
pub mod trace;
