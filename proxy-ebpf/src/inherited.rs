//! Flows kproxy inherited from netfilter (kube-proxy's): see
//! [`proxy_common::inherited`].
use proxy_common::{
    inherited::any_client,
    maps::{CT_DIR_FORWARD, CtKeyV4},
};

use crate::{
    maps::{INHERITED_V4, KEY_SCRATCH},
    parse::Flow,
};

/// Whether the flow of this forward key was netfilter's before kproxy
/// attached, and is still open: its packets are netfilter's to translate.
#[inline(always)]
pub fn is_open(forward_key: &CtKeyV4) -> bool {
    // SAFETY: only tested for presence.
    unsafe { INHERITED_V4.get(forward_key) }.is_some()
}

/// [`is_open`] for a sender whose address the socket hooks do not know.
#[inline(always)]
pub fn is_open_for_any_client(forward_key: &CtKeyV4) -> bool {
    is_open(&any_client(forward_key))
}

/// Whether a netfilter entry already has this reply tuple: a new flow with it
/// would be dropped when netfilter confirms it.
#[inline(always)]
pub fn holds_reply(reply_key: &CtKeyV4) -> bool {
    // SAFETY: only tested for presence.
    unsafe { INHERITED_V4.get(reply_key) }.is_some()
}

/// [`is_open`] for the flow's forward key, built in per-CPU scratch space
/// rather than on the stack (for XDP, whose stack is full).
#[inline(always)]
pub fn is_open_off_stack(flow: &Flow) -> bool {
    let Some(key) = KEY_SCRATCH.get_ptr_mut(0) else { return false };
    // SAFETY: this CPU's scratch value, valid for the program's run.
    // A reference, not `*key`: a copy would put the key back on the stack.
    #[allow(clippy::needless_borrows_for_generic_args)]
    unsafe {
        *key = flow.ct_key(CT_DIR_FORWARD);
        INHERITED_V4.get(&*key).is_some()
    }
}

/// [`holds_reply`] for the reply key of `forward_key` sent to a backend,
/// built off the stack as in [`is_open_off_stack`].
#[inline(always)]
pub fn holds_reply_off_stack(forward_key: &CtKeyV4, backend_addr: [u8; 4], backend_port: [u8; 2]) -> bool {
    let Some(key) = KEY_SCRATCH.get_ptr_mut(0) else { return false };
    // SAFETY: as above.
    #[allow(clippy::needless_borrows_for_generic_args)]
    unsafe {
        *key = forward_key.reply_of(backend_addr, backend_port);
        INHERITED_V4.get(&*key).is_some()
    }
}
