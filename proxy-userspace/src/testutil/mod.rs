//! Helpers for the crate's unit tests.

pub mod conntrack;
pub mod http;
mod temp_dir;

pub use temp_dir::TempDir;
