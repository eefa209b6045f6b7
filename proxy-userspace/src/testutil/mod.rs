//! Helpers for the crate's unit tests.

pub mod http;
