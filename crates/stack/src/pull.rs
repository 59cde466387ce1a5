//! Getting a model onto this machine before a replica needs it: `strata up` pulls each
//! pool's model once at start (replicas would race to pull it), and a rollout pulls its
//! new version before starting canary replicas.

use std::process::ExitStatus;

/// A model that could not be pulled. A cause is part of the message (not a `source`), so
/// that it is printed once, as the CLI prints the whole chain.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("finding the strata executable: {0}")]
    Executable(std::io::Error),
    #[error("running strata model pull: {0}")]
    Run(std::io::Error),
    #[error("pulling {model} failed ({status})")]
    Failed { model: String, status: ExitStatus },
}

/// Pulls `model` with `strata model pull` (progress on this terminal) unless it is a path
/// (a file, or a model directory).
pub fn pull_model(model: &str) -> Result<(), PullError> {
    let path = std::path::Path::new(model);
    if path.is_file() || crate::pools::is_model_dir(path) {
        return Ok(());
    }
    let exe = std::env::current_exe().map_err(PullError::Executable)?;
    let status = std::process::Command::new(exe)
        .args(["model", "pull", model])
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(PullError::Run)?;
    if !status.success() {
        return Err(PullError::Failed {
            model: model.to_string(),
            status,
        });
    }
    Ok(())
}
