//! sandbox
