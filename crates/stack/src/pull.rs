//! Getting a model onto this machine before a replica needs it: `strata up` pulls each
//! pool's model once at start (replicas would race to pull it), and a rollout pulls its
//! new version before starting canary replicas.

use anyhow::Context;

/// Pulls `model` with `strata model pull` (progress on this terminal) unless it is a path
/// (a file, or a model directory).
pub fn pull_model(model: &str) -> anyhow::Result<()> {
    let path = std::path::Path::new(model);
    if path.is_file() || crate::pools::is_model_dir(path) {
        return Ok(());
    }
    let exe = std::env::current_exe().context("finding the strata executable")?;
    let status = std::process::Command::new(exe)
        .args(["model", "pull", model])
        .stdout(std::process::Stdio::null())
        .status()
        .context("running strata model pull")?;
    anyhow::ensure!(status.success(), "pulling {model} failed ({status})");
    Ok(())
}
