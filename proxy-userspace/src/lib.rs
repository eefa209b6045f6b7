//! The `kproxy` agent and operator commands.

pub mod agent;
pub mod datapath;
pub mod dump;
pub mod manifest;
pub mod model;
pub mod sync;
