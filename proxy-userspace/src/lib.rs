//! The `kproxy` agent and operator commands.

pub mod manifest;
pub mod model;
