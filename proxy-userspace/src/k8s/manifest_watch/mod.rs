//! The manifests source: a file or directory of YAML, re-read when it
//! changes, delivered to the sync loop as a whole [`Snapshot`](crate::k8s::api_watch::Snapshot), keeping the
//! last good state of whatever cannot be read as it is now.
//!
//! - A file is read once `stat` has said the same of it (size, times, inode)
//!   at two polls in a row, so a file being written is not read half-way.
//! - A file that reads cleanly is authoritative: what it no longer holds is
//!   removed. A file with errors replaces what its readable documents hold and
//!   removes nothing: every object it held that is not in them (a Service whose
//!   document no longer parses, a slice with a type error) keeps its last good
//!   version, and the error names the file, the document and that object. A
//!   file that cannot be read at all (a FIFO, too large, not UTF-8, gone from
//!   an unreadable directory) keeps all it held.
//! - A file that is now a strict prefix of what was last applied (emptied, cut
//!   short) or stops in the middle of a line it did not before looks like a
//!   rewrite in progress: it is applied only once it has stayed so for
//!   [`SETTLE`].
//! - The manifests path itself vanishing or becoming unreadable changes
//!   nothing; a file removed from a directory that can be listed is removed
//!   (once it has been missing at two polls).
//! - Objects are numbered in the order they first appear (newcomers of one
//!   poll by namespace, name and position, as before), and the model sees
//!   Services in that order, so an address stays with the Service that held
//!   it until that Service goes.
//!
//! Reading and parsing happen on a thread of their own: `/healthz`,
//! `/metrics` and the sync loop never wait for them, and a read in progress
//! never holds up the exit on SIGTERM (a `spawn_blocking` task would: the
//! runtime waits for those when it shuts down).
//!
//! Files: this one (the reader thread and what it publishes), `merge` (a file's objects, and a
//! read applied to what the file held), `watcher` (the path, polled file by file, and the snapshot).

mod merge;
#[cfg(test)]
mod tests;
mod watcher;

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use watcher::Watcher;

use crate::k8s::api_watch::Changes;

/// What the manifests source last reported; rendered once it has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ManifestState {
    pub objects_kept: u64,
    pub errors: u64,
}

/// The manifests source reads on a thread of its own, apart from the sync loop and started without a
/// metrics handle, so it publishes here, process-wide (the agent's `/metrics` reads [`last_state`]).
static MANIFESTS: Mutex<Option<ManifestState>> = Mutex::new(None);

/// Publishes the manifests source's current state.
pub fn set_manifest_state(state: ManifestState) {
    *MANIFESTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(state);
}

/// What the manifests source last published, if it has.
pub fn last_state() -> Option<ManifestState> {
    *MANIFESTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How long a file that looks cut short (see [`merge::looks_unfinished`]) must stay
/// so before it is applied: longer than a writer pauses between two writes.
pub const SETTLE: Duration = Duration::from_secs(5);

/// A poll (listing, reading and parsing what changed) taking longer than this
/// is reported, naming the file; the last good state stays programmed.
const READ_BUDGET: Duration = Duration::from_secs(2);

/// Appended to an error whose object keeps its last good version.
const KEPT: &str = "the last good version stays programmed";

/// Re-reads the manifests whenever a file changes (checked every `poll`).
pub async fn watch_files(path: PathBuf, poll: Duration, changes: Arc<Changes>) -> Result<()> {
    let progress = Arc::new(Progress::default());
    let stop = Arc::new(AtomicBool::new(false));
    // The thread stops at its next poll once this future is dropped.
    let _stop = StopOnDrop(Arc::clone(&stop));
    {
        let progress = Arc::clone(&progress);
        let stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("kproxy-manifests".to_string())
            .spawn(move || {
                let mut watcher = Watcher::new(path);
                while !stop.load(Ordering::Relaxed) {
                    if let Some(snapshot) = watcher.poll(Instant::now(), &progress) {
                        changes.replace_all(snapshot);
                    }
                    set_manifest_state(watcher.state);
                    progress.idle();
                    std::thread::sleep(poll);
                }
            })
            .context("starting the manifests reader thread")?;
    }
    // A read cannot be interrupted; one that outlasts the budget is reported.
    let mut reported = None;
    loop {
        tokio::time::sleep(poll.clamp(Duration::from_millis(100), READ_BUDGET)).await;
        if let Some((since, file)) = progress.busy()
            && since.elapsed() > READ_BUDGET
            && reported != Some(since)
        {
            tracing::warn!(
                file = %file.display(),
                seconds = since.elapsed().as_secs(),
                "reading the manifests takes longer than {READ_BUDGET:?}; {KEPT} until it finishes"
            );
            reported = Some(since);
        }
    }
}

struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What the reader thread is doing: since when, and which file.
#[derive(Default)]
struct Progress(Mutex<Option<(Instant, PathBuf)>>);

impl Progress {
    fn reading(&self, since: Instant, file: &Path) {
        *self.0.lock().expect("poisoned") = Some((since, file.to_path_buf()));
    }

    fn idle(&self) {
        *self.0.lock().expect("poisoned") = None;
    }

    fn busy(&self) -> Option<(Instant, PathBuf)> {
        self.0.lock().expect("poisoned").clone()
    }
}
