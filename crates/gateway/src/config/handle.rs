//! The live config, swapped atomically on reload; reload refuses what only a restart can change.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use parking_lot::RwLock;

use super::{invalid, Config, ConfigError, Resolved};

/// The live config, swapped atomically on reload.
pub struct ConfigHandle {
    path: Option<PathBuf>,
    current: RwLock<Arc<Resolved>>,
    mtime: RwLock<Option<SystemTime>>,
}

impl ConfigHandle {
    /// Loads `path` (or an empty config when `None`).
    pub fn open(path: Option<&Path>) -> Result<ConfigHandle, ConfigError> {
        let (config, mtime) = match path {
            Some(p) => (Config::load(p)?, file_mtime(p)),
            None => (Config::default(), None),
        };
        let base_dir = path.and_then(Path::parent);
        Ok(ConfigHandle {
            path: path.map(Path::to_path_buf),
            current: RwLock::new(Arc::new(Resolved::build(config, base_dir, None)?)),
            mtime: RwLock::new(mtime),
        })
    }

    /// A fixed config (tests, embedding).
    pub fn fixed(config: Config) -> Result<ConfigHandle, ConfigError> {
        Ok(ConfigHandle {
            path: None,
            current: RwLock::new(Arc::new(Resolved::new(config)?)),
            mtime: RwLock::new(None),
        })
    }

    pub fn get(&self) -> Arc<Resolved> {
        self.current.read().clone()
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Re-reads the file. On error the old config stays and the error is returned.
    pub fn reload(&self) -> Result<(), ConfigError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let mtime = file_mtime(path);
        let previous = self.get();
        let resolved = Config::load(path)
            .and_then(|c| refuse_restart_only_change(&previous.config, c))
            .and_then(|c| Resolved::build(c, path.parent(), Some(&previous)));
        // Remember the mtime even on failure so an invalid file is reported once, not on
        // every poll.
        *self.mtime.write() = mtime;
        *self.current.write() = Arc::new(resolved?);
        Ok(())
    }

    /// Reloads when the file's modification time changed since the last (attempted) load.
    pub fn reload_if_changed(&self) -> Option<Result<(), ConfigError>> {
        let path = self.path.as_ref()?;
        let now = file_mtime(path);
        if now == *self.mtime.read() {
            return None;
        }
        Some(self.reload())
    }

    /// Replaces the config with an already-validated one (tests).
    pub fn replace(&self, config: Config) -> Result<(), ConfigError> {
        let previous = self.get();
        let config = refuse_restart_only_change(&previous.config, config)?;
        *self.current.write() = Arc::new(Resolved::build(config, None, Some(&previous))?);
        Ok(())
    }
}

/// `new`, unless it changes a key the running gateway read only at start: then the reload
/// is refused naming that key, so "reloaded" never hides a value still in force.
pub(super) fn refuse_restart_only_change(
    running: &Config,
    new: Config,
) -> Result<Config, ConfigError> {
    let as_value = |c: &Config| serde_json::to_value(c).unwrap_or(serde_json::Value::Null);
    match crate::restart_only::changed_restart_only_key(&as_value(running), &as_value(&new)) {
        Some(key) => Err(invalid(format!(
            "`{key}` cannot change while the gateway runs; restart it to apply the new value"
        ))),
        None => Ok(new),
    }
}

pub(super) fn file_mtime(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}
