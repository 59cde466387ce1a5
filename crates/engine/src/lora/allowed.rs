//! Where `POST /v1/load_lora_adapter` may read from (`--lora-dir`).
//!
//! A client names a path; without a fence it could make the engine open any file the
//! process can read and learn from the answer whether it exists or what it starts with.
//! A path is accepted only when, with every link and `..` resolved, it lies under one of
//! the operator's directories. Every refusal is the same 400 that names only the rule, so
//! the answer says nothing about what lies outside.

use std::path::{Path, PathBuf};

use strata_api::ApiError;

/// The directories runtime loads may read from, canonical.
#[derive(Debug, Clone, Default)]
pub struct AllowedDirs {
    dirs: Vec<PathBuf>,
}

/// The one answer to a path outside the directories (or one that cannot be resolved).
pub const OUTSIDE: &str =
    "lora_path must name an adapter under a directory the engine was started with (--lora-dir).";

impl AllowedDirs {
    /// Canonicalizes each `--lora-dir`; one that does not resolve to a directory stops the
    /// start-up, naming it.
    pub fn new(dirs: &[PathBuf]) -> Result<Self, String> {
        let dirs = dirs
            .iter()
            .map(|d| match std::fs::canonicalize(d) {
                Ok(c) if c.is_dir() => Ok(c),
                Ok(_) => Err(format!("--lora-dir {}: not a directory", d.display())),
                Err(e) => Err(format!("--lora-dir {}: {e}", d.display())),
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { dirs })
    }

    /// The canonical form of `path` when it lies under an allowed directory; otherwise
    /// the 400 of [`OUTSIDE`], whether or not the path exists.
    pub fn check(&self, path: &str) -> Result<PathBuf, ApiError> {
        let outside = || ApiError::invalid("lora_path", OUTSIDE);
        let resolved = resolve(Path::new(path)).ok_or_else(outside)?;
        if self.dirs.iter().any(|d| resolved.starts_with(d)) {
            Ok(resolved)
        } else {
            Err(outside())
        }
    }
}

/// `path` canonical; a path that does not exist yet resolves through its parent, so an
/// inside path with nothing there still earns its 404 and an outside one the same 400 as
/// an existing file.
fn resolve(path: &Path) -> Option<PathBuf> {
    if !path.is_absolute() {
        return None;
    }
    if let Ok(c) = std::fs::canonicalize(path) {
        return Some(c);
    }
    let name = path.file_name()?;
    if name == ".." {
        return None;
    }
    Some(std::fs::canonicalize(path.parent()?).ok()?.join(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_paths_under_the_directories_resolve_and_refusals_are_alike() {
        let root = std::env::temp_dir().join(format!("strata-lora-allowed-{}", std::process::id()));
        let inside = root.join("adapters");
        std::fs::create_dir_all(inside.join("a")).unwrap();
        std::fs::write(root.join("secret"), b"root:x").unwrap();
        let allowed = AllowedDirs::new(std::slice::from_ref(&inside)).unwrap();
        let canon = std::fs::canonicalize(&inside).unwrap();
        assert_eq!(
            allowed.check(&inside.join("a").to_string_lossy()).unwrap(),
            canon.join("a")
        );
        // Nothing there yet, but inside: resolved, so the load can answer its 404.
        assert_eq!(
            allowed.check(&inside.join("b").to_string_lossy()).unwrap(),
            canon.join("b")
        );
        let outside = [
            root.join("secret"),
            root.join("nothing-here"),
            inside.join("../secret"),
            inside.join("a/../../secret"),
            PathBuf::from("/etc/shadow"),
            PathBuf::from("/no/such/dir/x"),
            PathBuf::from("adapters/a"),
        ];
        for p in outside {
            let err = allowed.check(&p.to_string_lossy()).unwrap_err();
            assert_eq!((err.status, err.message.as_str()), (400, OUTSIDE), "{p:?}");
        }
        assert!(AllowedDirs::default()
            .check(&inside.to_string_lossy())
            .is_err());
        assert!(AllowedDirs::new(&[root.join("secret")]).is_err());
        let _ = std::fs::remove_dir_all(&root);
    }
}
