//! kproxy
