//! The manifests source: a file or directory of YAML, re-read when it
//! changes, delivered to the sync loop as a whole [`Snapshot`].

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use anyhow::Result;

use crate::{
    manifest,
    source::{Changes, Snapshot},
};

/// Identifies the state of manifest files: any write, rename, addition or
/// removal changes it.
fn fingerprint(path: &Path) -> Vec<(PathBuf, Option<SystemTime>, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        match std::fs::metadata(&p) {
            Ok(meta) if meta.is_dir() => {
                if let Ok(entries) = std::fs::read_dir(&p) {
                    stack.extend(entries.filter_map(|e| e.ok().map(|e| e.path())));
                }
            }
            Ok(meta) => out.push((p, meta.modified().ok(), meta.len())),
            Err(_) => out.push((p, None, 0)),
        }
    }
    out.sort();
    out
}

/// Re-reads the manifests whenever a file changes (checked every `poll`).
pub async fn watch_files(path: PathBuf, poll: Duration, changes: Arc<Changes>) -> Result<()> {
    let mut last = None;
    loop {
        let current = fingerprint(&path);
        if last.as_ref() != Some(&current) {
            let objects = manifest::load_path(&path);
            let mut snapshot = Snapshot { errors: objects.errors, ..Default::default() };
            for (i, s) in objects.services.into_iter().enumerate() {
                let (ns, name) = (s.object.metadata.namespace.clone(), s.object.metadata.name.clone());
                snapshot
                    .services
                    .insert((ns.unwrap_or_default(), name.unwrap_or_default(), i as u32), Arc::new(s));
            }
            for (i, s) in objects.slices.into_iter().enumerate() {
                let (ns, name) = (s.object.metadata.namespace.clone(), s.object.metadata.name.clone());
                snapshot
                    .slices
                    .insert((ns.unwrap_or_default(), name.unwrap_or_default(), i as u32), Arc::new(s));
            }
            changes.replace_all(snapshot);
            last = Some(current);
        }
        tokio::time::sleep(poll).await;
    }
}
