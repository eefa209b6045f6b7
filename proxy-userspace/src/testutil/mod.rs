//! Helpers for the crate's unit tests.

pub mod conntrack;
pub mod http;
