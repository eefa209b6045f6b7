//! `kproxy agent`: keeps the datapath equal to the manifests on disk and
//! attached to every pod-facing interface, until SIGTERM or Ctrl-C.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, SystemTime},
};

use anyhow::{Context as _, Result};

use crate::{
    datapath::{self, InterfaceSelector, Maps, PinDir},
    manifest, model,
    sync::Syncer,
};

pub struct AgentConfig {
    pub pins: PinDir,
    pub manifests: PathBuf,
    pub interfaces: Vec<String>,
    /// How often interfaces and manifests are checked for changes.
    pub poll: Duration,
}

/// Identifies the state of the manifest files: any write, rename, addition
/// or removal changes it.
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

pub fn run(config: &AgentConfig, stop: Arc<AtomicBool>) -> Result<()> {
    let selector = InterfaceSelector::new(&config.interfaces)?;
    if datapath::load(&config.pins)? {
        tracing::info!(pins = %config.pins.root().display(), "loaded and pinned the datapath");
    } else {
        tracing::info!(pins = %config.pins.root().display(), "reusing the pinned datapath");
    }
    let mut syncer = Syncer::from_maps(Maps::from_pins(&config.pins)?).context("reading the pinned maps")?;
    tracing::info!(
        frontends = syncer.frontend_count(),
        backends = syncer.backend_count(),
        "adopted the maps' contents"
    );

    let mut last_fingerprint = None;
    while !stop.load(Ordering::Relaxed) {
        match datapath::attach_matching(&config.pins, &selector) {
            Ok(report) => {
                for label in &report.attached {
                    tracing::info!(hook = %label, "attached");
                }
                for label in &report.pruned {
                    tracing::info!(link = %label, "interface gone, link removed");
                }
                for (label, error) in &report.failed {
                    tracing::warn!(hook = %label, %error, "attach failed; will retry");
                }
            }
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "listing interfaces failed"),
        }

        let current = fingerprint(&config.manifests);
        if last_fingerprint.as_ref() != Some(&current) {
            sync_once(&config.manifests, &mut syncer);
            last_fingerprint = Some(current);
        }
        sleep_unless_stopped(config.poll, &stop);
    }
    tracing::info!("stopping; the pinned datapath stays in place");
    Ok(())
}

fn sync_once(manifests: &Path, syncer: &mut Syncer) {
    let started = std::time::Instant::now();
    let objects = manifest::load_path(manifests);
    let (desired, model_errors) = model::build(&objects.services, &objects.slices);
    for error in objects.errors.iter().chain(&model_errors) {
        tracing::error!("{error}");
    }
    let report = syncer.apply(&desired);
    for error in &report.errors {
        tracing::error!("{error}");
    }
    tracing::info!(
        services = objects.services.len(),
        endpoint_slices = objects.slices.len(),
        frontends = desired.frontends.len(),
        added = report.frontends_added,
        updated = report.frontends_updated,
        removed = report.frontends_removed,
        backends_added = report.backends_added,
        backends_removed = report.backends_removed,
        errors = objects.errors.len() + model_errors.len() + report.errors.len(),
        elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
        "synced"
    );
}

fn sleep_unless_stopped(total: Duration, stop: &AtomicBool) {
    let step = Duration::from_millis(50);
    let mut slept = Duration::ZERO;
    while slept < total && !stop.load(Ordering::Relaxed) {
        std::thread::sleep(step);
        slept += step;
    }
}
