//! The model registry: models are referred to by SHA-256 digest, and signed.
//!
//! A model is a file (a GGUF) or a directory of files. Its *manifest* lists every file's
//! SHA-256; its *digest* is the SHA-256 over the file digests in path order, so a model
//! has one digest however it is laid out. `sign` writes, beside the model, a signature in
//! the shape of OpenSSF model signing: a Sigstore-style bundle holding a DSSE envelope
//! whose payload is an in-toto statement (subject: the model's digest; predicate: the
//! per-file manifest), signed with ed25519. `verify` checks the signature with a public
//! key, then rehashes the files and names every file that was changed, removed or added.
//!
//! Keys are PKCS#8 / SPKI PEM, the formats other tools read (`openssl pkey -in FILE`).
//!
//! Names resolve to digests through [`ModelRegistry`]; a name without a pinned digest is
//! refused, so a model can never float.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use base64::Engine as _;
use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};
use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// The DSSE payload type of an in-toto statement.
pub const PAYLOAD_TYPE: &str = "application/vnd.in-toto+json";
/// The in-toto statement type.
pub const STATEMENT_TYPE: &str = "https://in-toto.io/Statement/v1";
/// The predicate type OpenSSF model signing uses for its manifests.
pub const PREDICATE_TYPE: &str = "https://model_signing/signature/v1.0";
/// The bundle media type the signature file carries.
pub const BUNDLE_MEDIA_TYPE: &str = "application/vnd.dev.sigstore.bundle.v0.3+json";
/// The signature file's name inside a model directory.
pub const DIR_SIGNATURE_NAME: &str = "model.sig";

/// A SHA-256 digest, written `sha256:<64 hex>`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The 64 lowercase hex digits.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Digest {
    type Err = RegistryError;
    fn from_str(s: &str) -> Result<Digest, RegistryError> {
        let hex_part = s.strip_prefix("sha256:").unwrap_or(s);
        let mut out = [0u8; 32];
        if hex_part.len() != 64 {
            return Err(RegistryError::BadDigest(s.to_string()));
        }
        hex::decode_to_slice(hex_part, &mut out)
            .map_err(|_| RegistryError::BadDigest(s.to_string()))?;
        Ok(Digest(out))
    }
}

impl Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Digest, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Problems with keys, digests and the registry (not verification: see [`VerifyError`]).
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("`{0}` is not a SHA-256 digest (want sha256:<64 hex digits>)")]
    BadDigest(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: not an ed25519 key in PEM ({detail})")]
    BadKey { path: PathBuf, detail: String },
    #[error("{0} is a symbolic link; models are signed without following links")]
    Symlink(PathBuf),
    #[error("{0}: nothing to sign (no files)")]
    Empty(PathBuf),
    #[error("unknown model `{0}`")]
    UnknownModel(String),
    #[error("model `{name}` is pinned to {pinned}, not {asked}")]
    DigestMismatch {
        name: String,
        pinned: Digest,
        asked: Digest,
    },
    #[error("the system random source failed: {0}")]
    Random(String),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> RegistryError + '_ {
    move |source| RegistryError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One file of a model and its digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resource {
    /// Path relative to the model directory, `/`-separated (the file name for a one-file
    /// model).
    pub name: String,
    pub algorithm: String,
    /// 64 hex digits.
    pub digest: String,
}

/// Every file of a model with its SHA-256, sorted by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub resources: Vec<Resource>,
}

impl Manifest {
    /// The model's digest: SHA-256 over the raw file digests in name order.
    pub fn model_digest(&self) -> Digest {
        let mut h = Sha256::new();
        for r in &self.resources {
            let mut raw = [0u8; 32];
            if hex::decode_to_slice(&r.digest, &mut raw).is_ok() {
                h.update(raw);
            } else {
                h.update(r.digest.as_bytes());
            }
        }
        Digest(h.finalize().into())
    }
}

/// SHA-256 of one file, streamed.
pub fn digest_file(path: &Path) -> Result<Digest, RegistryError> {
    let mut f = fs::File::open(path).map_err(io_err(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(Digest(h.finalize().into()))
}

/// Where the signature of the model at `path` lives: `DIR/model.sig` for a directory,
/// `FILE.sig` beside a file.
pub fn signature_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(DIR_SIGNATURE_NAME)
    } else {
        let mut s = path.as_os_str().to_os_string();
        s.push(".sig");
        PathBuf::from(s)
    }
}

fn model_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".to_string())
}

/// Hashes every file of the model at `path` (a file or a directory), skipping the model's
/// own signature file. Symbolic links are refused.
pub fn manifest(path: &Path) -> Result<Manifest, RegistryError> {
    let meta = fs::symlink_metadata(path).map_err(io_err(path))?;
    if meta.file_type().is_symlink() {
        return Err(RegistryError::Symlink(path.to_path_buf()));
    }
    let mut resources = Vec::new();
    if meta.is_file() {
        resources.push(Resource {
            name: model_name(path),
            algorithm: "sha256".into(),
            digest: digest_file(path)?.hex(),
        });
    } else {
        let sig = signature_path(path);
        let mut files = Vec::new();
        walk(path, path, &sig, &mut files)?;
        files.sort();
        for (name, full) in files {
            resources.push(Resource {
                name,
                algorithm: "sha256".into(),
                digest: digest_file(&full)?.hex(),
            });
        }
        if resources.is_empty() {
            return Err(RegistryError::Empty(path.to_path_buf()));
        }
    }
    Ok(Manifest { resources })
}

fn walk(
    root: &Path,
    dir: &Path,
    skip: &Path,
    out: &mut Vec<(String, PathBuf)>,
) -> Result<(), RegistryError> {
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let full = entry.path();
        let ft = entry.file_type().map_err(io_err(&full))?;
        if ft.is_symlink() {
            return Err(RegistryError::Symlink(full));
        }
        if ft.is_dir() {
            walk(root, &full, skip, out)?;
        } else if full != skip {
            let rel = full.strip_prefix(root).unwrap_or(&full);
            let name = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            out.push((name, full));
        }
    }
    Ok(())
}

// ----- the signed statement -----

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Statement {
    #[serde(rename = "_type")]
    statement_type: String,
    subject: Vec<Subject>,
    #[serde(rename = "predicateType")]
    predicate_type: String,
    predicate: Predicate,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Subject {
    name: String,
    digest: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Predicate {
    serialization: Serialization,
    resources: Vec<Resource>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Serialization {
    method: String,
    hash_type: String,
    allow_symlinks: bool,
    ignore_paths: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Bundle {
    #[serde(rename = "mediaType")]
    media_type: String,
    #[serde(rename = "verificationMaterial")]
    verification_material: VerificationMaterial,
    #[serde(rename = "dsseEnvelope")]
    dsse_envelope: Envelope,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct VerificationMaterial {
    #[serde(rename = "publicKey")]
    public_key: PublicKeyHint,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PublicKeyHint {
    hint: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Envelope {
    payload: String,
    #[serde(rename = "payloadType")]
    payload_type: String,
    signatures: Vec<EnvelopeSignature>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct EnvelopeSignature {
    sig: String,
    #[serde(default)]
    keyid: String,
}

/// DSSE's pre-authentication encoding: what is actually signed.
fn pae(payload_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + payload_type.len() + 32);
    out.extend_from_slice(b"DSSEv1 ");
    out.extend_from_slice(payload_type.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload_type.as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload.len().to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(payload);
    out
}

/// A key's id: the hex SHA-256 of its raw public key bytes.
pub fn key_id(key: &VerifyingKey) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

// ----- keys -----

/// Writes a new ed25519 key pair: the private key to `out` (PKCS#8 PEM, mode 0600) and
/// the public key to `out.pub` (SPKI PEM). Refuses to overwrite either.
pub fn keygen(out: &Path) -> Result<VerifyingKey, RegistryError> {
    use rand::TryRngCore;
    let mut seed = [0u8; 32];
    rand::rngs::OsRng
        .try_fill_bytes(&mut seed)
        .map_err(|e| RegistryError::Random(e.to_string()))?;
    let key = SigningKey::from_bytes(&seed);
    // PKCS#8 v1 (no embedded public key): the form every PEM reader accepts.
    let keypair = ed25519_dalek::pkcs8::KeypairBytes {
        secret_key: key.to_bytes(),
        public_key: None,
    };
    let private = keypair
        .to_pkcs8_pem(Default::default())
        .map_err(|e| RegistryError::BadKey {
            path: out.to_path_buf(),
            detail: e.to_string(),
        })?;
    let public = key
        .verifying_key()
        .to_public_key_pem(Default::default())
        .map_err(|e| RegistryError::BadKey {
            path: out.to_path_buf(),
            detail: e.to_string(),
        })?;
    let pub_path = public_key_path(out);
    write_new(out, private.as_bytes(), true)?;
    write_new(&pub_path, public.as_bytes(), false)?;
    Ok(key.verifying_key())
}

/// `FILE.pub` for `FILE`.
pub fn public_key_path(private: &Path) -> PathBuf {
    let mut s = private.as_os_str().to_os_string();
    s.push(".pub");
    PathBuf::from(s)
}

fn write_new(path: &Path, bytes: &[u8], private: bool) -> Result<(), RegistryError> {
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(if private { 0o600 } else { 0o644 });
    }
    #[cfg(not(unix))]
    let _ = private;
    let mut f = opts.open(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

/// Reads a private key written by [`keygen`] (or any PKCS#8 PEM ed25519 key).
pub fn read_signing_key(path: &Path) -> Result<SigningKey, RegistryError> {
    let pem = fs::read_to_string(path).map_err(io_err(path))?;
    SigningKey::from_pkcs8_pem(&pem).map_err(|e| RegistryError::BadKey {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

/// Reads a public key written by [`keygen`] (or any SPKI PEM ed25519 key).
pub fn read_verifying_key(path: &Path) -> Result<VerifyingKey, RegistryError> {
    let pem = fs::read_to_string(path).map_err(io_err(path))?;
    VerifyingKey::from_public_key_pem(&pem).map_err(|e| RegistryError::BadKey {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

// ----- sign and verify -----

/// Signs the model at `path` and writes the signature beside it ([`signature_path`]).
/// Returns the model's digest and where the signature went.
pub fn sign(path: &Path, key: &SigningKey) -> Result<(Digest, PathBuf), RegistryError> {
    let m = manifest(path)?;
    let digest = m.model_digest();
    let sig_path = signature_path(path);
    let statement = Statement {
        statement_type: STATEMENT_TYPE.into(),
        subject: vec![Subject {
            name: model_name(path),
            digest: BTreeMap::from([("sha256".to_string(), digest.hex())]),
        }],
        predicate_type: PREDICATE_TYPE.into(),
        predicate: Predicate {
            serialization: Serialization {
                method: "files".into(),
                hash_type: "sha256".into(),
                allow_symlinks: false,
                ignore_paths: vec![model_name(&sig_path)],
            },
            resources: m.resources,
        },
    };
    // serde_json writes struct fields in declaration order and maps in key order, so the
    // payload bytes are canonical for a given manifest.
    let payload = serde_json::to_vec(&statement).map_err(|e| RegistryError::BadKey {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    let signature = key.sign(&pae(PAYLOAD_TYPE, &payload));
    let b64 = base64::engine::general_purpose::STANDARD;
    let id = key_id(&key.verifying_key());
    let bundle = Bundle {
        media_type: BUNDLE_MEDIA_TYPE.into(),
        verification_material: VerificationMaterial {
            public_key: PublicKeyHint { hint: id.clone() },
        },
        dsse_envelope: Envelope {
            payload: b64.encode(&payload),
            payload_type: PAYLOAD_TYPE.into(),
            signatures: vec![EnvelopeSignature {
                sig: b64.encode(signature.to_bytes()),
                keyid: id,
            }],
        },
    };
    let mut text = serde_json::to_vec_pretty(&bundle).map_err(|e| RegistryError::BadKey {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })?;
    text.push(b'\n');
    // Write then rename, so a reader never sees half a signature.
    let tmp = {
        let mut s = sig_path.as_os_str().to_os_string();
        s.push(".tmp");
        PathBuf::from(s)
    };
    fs::write(&tmp, &text).map_err(io_err(&tmp))?;
    fs::rename(&tmp, &sig_path).map_err(io_err(&sig_path))?;
    Ok((digest, sig_path))
}

/// One way a model differs from its signed manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Difference {
    Changed {
        name: String,
        signed: String,
        actual: String,
    },
    Missing {
        name: String,
    },
    Extra {
        name: String,
    },
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Difference::Changed {
                name,
                signed,
                actual,
            } => write!(
                f,
                "{name}: changed (signed sha256:{signed}, now sha256:{actual})"
            ),
            Difference::Missing { name } => write!(f, "{name}: missing (signed, not present)"),
            Difference::Extra { name } => write!(f, "{name}: extra (present, not signed)"),
        }
    }
}

/// Why a model did not verify.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("no signature at {0}")]
    NoSignature(PathBuf),
    #[error("{path}: malformed signature: {detail}")]
    Malformed { path: PathBuf, detail: String },
    #[error("the signature does not verify with this key (wrong key, or the signature or manifest was altered)")]
    BadSignature,
    #[error("the model differs from its signed manifest:\n  {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
    Mismatch(Vec<Difference>),
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// Verifies the model at `path` against its signature with `key`, returning its digest.
///
/// The engine calls this before loading a model when verification is on.
pub fn verify_model(path: &Path, key: &VerifyingKey) -> Result<Digest, VerifyError> {
    let sig_path = signature_path(path);
    let text = match fs::read(&sig_path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(VerifyError::NoSignature(sig_path))
        }
        Err(e) => return Err(io_err(&sig_path)(e).into()),
    };
    let malformed = |detail: String| VerifyError::Malformed {
        path: sig_path.clone(),
        detail,
    };
    let bundle: Bundle = serde_json::from_slice(&text).map_err(|e| malformed(e.to_string()))?;
    let env = &bundle.dsse_envelope;
    if env.payload_type != PAYLOAD_TYPE {
        return Err(malformed(format!("payload type `{}`", env.payload_type)));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let payload = b64
        .decode(&env.payload)
        .map_err(|e| malformed(format!("payload: {e}")))?;
    let signed = pae(&env.payload_type, &payload);
    // Any one signature by this key is enough.
    let mut ok = false;
    for s in &env.signatures {
        let Ok(raw) = b64.decode(&s.sig) else {
            continue;
        };
        let Ok(sig) = Signature::from_slice(&raw) else {
            continue;
        };
        if key.verify(&signed, &sig).is_ok() {
            ok = true;
            break;
        }
    }
    if !ok {
        return Err(VerifyError::BadSignature);
    }
    // Only now, with the payload authenticated, is its content trusted.
    let statement: Statement =
        serde_json::from_slice(&payload).map_err(|e| malformed(format!("statement: {e}")))?;
    if statement.predicate_type != PREDICATE_TYPE {
        return Err(malformed(format!(
            "predicate type `{}`",
            statement.predicate_type
        )));
    }
    let actual = manifest(path)?;
    let signed_files: BTreeMap<&str, &str> = statement
        .predicate
        .resources
        .iter()
        .map(|r| (r.name.as_str(), r.digest.as_str()))
        .collect();
    let actual_files: BTreeMap<&str, &str> = actual
        .resources
        .iter()
        .map(|r| (r.name.as_str(), r.digest.as_str()))
        .collect();
    let mut diffs = Vec::new();
    for (name, signed) in &signed_files {
        match actual_files.get(name) {
            None => diffs.push(Difference::Missing {
                name: name.to_string(),
            }),
            Some(a) if a != signed => diffs.push(Difference::Changed {
                name: name.to_string(),
                signed: signed.to_string(),
                actual: a.to_string(),
            }),
            Some(_) => {}
        }
    }
    for name in actual_files.keys() {
        if !signed_files.contains_key(name) {
            diffs.push(Difference::Extra {
                name: name.to_string(),
            });
        }
    }
    if !diffs.is_empty() {
        return Err(VerifyError::Mismatch(diffs));
    }
    let digest = actual.model_digest();
    let subject_ok = statement.subject.iter().any(|s| {
        s.digest
            .get("sha256")
            .is_some_and(|d| d.eq_ignore_ascii_case(&digest.hex()))
    });
    if !subject_ok {
        return Err(malformed(
            "subject digest does not match the manifest".into(),
        ));
    }
    Ok(digest)
}

/// [`verify_model`] with the public key read from a PEM file.
pub fn verify_model_with_key_file(path: &Path, key_file: &Path) -> Result<Digest, VerifyError> {
    let key = read_verifying_key(key_file)?;
    verify_model(path, &key)
}

// ----- names to digests -----

/// A model the controller may run, pinned by digest (`models:` in `controller.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelEntry {
    /// A GGUF file or a model directory.
    pub path: PathBuf,
    /// The model's digest ([`Manifest::model_digest`]).
    pub digest: Digest,
}

/// Names that resolve to pinned digests; never a floating tag.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ModelRegistry {
    pub models: BTreeMap<String, ModelEntry>,
}

impl ModelRegistry {
    /// Resolves `name`, `name@sha256:…` or `sha256:…` to its entry.
    pub fn resolve(&self, reference: &str) -> Result<(&str, &ModelEntry), RegistryError> {
        if reference.starts_with("sha256:") {
            let d: Digest = reference.parse()?;
            return self
                .models
                .iter()
                .find(|(_, e)| e.digest == d)
                .map(|(n, e)| (n.as_str(), e))
                .ok_or_else(|| RegistryError::UnknownModel(reference.to_string()));
        }
        let (name, asked) = match reference.split_once('@') {
            Some((n, d)) => (n, Some(d.parse::<Digest>()?)),
            None => (reference, None),
        };
        let (n, e) = self
            .models
            .get_key_value(name)
            .ok_or_else(|| RegistryError::UnknownModel(name.to_string()))?;
        if let Some(asked) = asked {
            if asked != e.digest {
                return Err(RegistryError::DigestMismatch {
                    name: name.to_string(),
                    pinned: e.digest,
                    asked,
                });
            }
        }
        Ok((n.as_str(), e))
    }

    /// Rehashes the entry's files and checks them against its pinned digest.
    pub fn check(&self, reference: &str) -> Result<Digest, RegistryError> {
        let (name, e) = self.resolve(reference)?;
        let actual = manifest(&e.path)?.model_digest();
        if actual != e.digest {
            return Err(RegistryError::DigestMismatch {
                name: name.to_string(),
                pinned: e.digest,
                asked: actual,
            });
        }
        Ok(actual)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_dir() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("model.gguf"), b"weights weights weights").unwrap();
        fs::write(d.path().join("tokenizer.json"), b"{\"vocab\":{}}").unwrap();
        fs::create_dir(d.path().join("extra")).unwrap();
        fs::write(d.path().join("extra/config.json"), b"{}").unwrap();
        d
    }

    fn keys(dir: &Path) -> (SigningKey, VerifyingKey, PathBuf) {
        let kp = dir.join("key");
        let vk = keygen(&kp).unwrap();
        let sk = read_signing_key(&kp).unwrap();
        assert_eq!(sk.verifying_key(), vk);
        assert_eq!(read_verifying_key(&public_key_path(&kp)).unwrap(), vk);
        (sk, vk, kp)
    }

    #[test]
    fn digest_parses_and_prints() {
        let d = Digest([0xab; 32]);
        let s = d.to_string();
        assert!(s.starts_with("sha256:abab"));
        assert_eq!(s.parse::<Digest>().unwrap(), d);
        assert_eq!(d.hex().parse::<Digest>().unwrap(), d);
        assert!("sha256:xyz".parse::<Digest>().is_err());
        assert!("sha256:".parse::<Digest>().is_err());
        assert!(format!("sha256:{}", "g".repeat(64))
            .parse::<Digest>()
            .is_err());
    }

    #[test]
    fn keygen_writes_pem_pair_and_refuses_to_overwrite() {
        let d = tempfile::tempdir().unwrap();
        let (_, _, kp) = keys(d.path());
        let text = fs::read_to_string(&kp).unwrap();
        assert!(text.starts_with("-----BEGIN PRIVATE KEY-----"));
        let pubtext = fs::read_to_string(public_key_path(&kp)).unwrap();
        assert!(pubtext.starts_with("-----BEGIN PUBLIC KEY-----"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&kp).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert!(matches!(keygen(&kp), Err(RegistryError::Io { .. })));
        // A public key is not a private key.
        assert!(matches!(
            read_signing_key(&public_key_path(&kp)),
            Err(RegistryError::BadKey { .. })
        ));
    }

    #[test]
    fn sign_then_verify_a_directory_and_a_single_file() {
        let d = model_dir();
        let k = tempfile::tempdir().unwrap();
        let (sk, vk, _) = keys(k.path());
        let (digest, sig) = sign(d.path(), &sk).unwrap();
        assert_eq!(sig, d.path().join("model.sig"));
        assert_eq!(verify_model(d.path(), &vk).unwrap(), digest);
        // Re-signing is stable: the signature file is not part of the model.
        let (again, _) = sign(d.path(), &sk).unwrap();
        assert_eq!(again, digest);

        let file = d.path().join("model.gguf");
        let (fd, fsig) = sign(&file, &sk).unwrap();
        assert_eq!(fsig, d.path().join("model.gguf.sig"));
        assert_eq!(verify_model(&file, &vk).unwrap(), fd);
        assert_ne!(fd, digest);

        // The envelope has the OpenSSF shape.
        let bundle: serde_json::Value = serde_json::from_slice(&fs::read(&fsig).unwrap()).unwrap();
        let env = &bundle["dsseEnvelope"];
        assert_eq!(env["payloadType"], PAYLOAD_TYPE);
        let payload = base64::engine::general_purpose::STANDARD
            .decode(env["payload"].as_str().unwrap())
            .unwrap();
        let st: serde_json::Value = serde_json::from_slice(&payload).unwrap();
        assert_eq!(st["_type"], STATEMENT_TYPE);
        assert_eq!(st["predicateType"], PREDICATE_TYPE);
        assert_eq!(st["subject"][0]["digest"]["sha256"], fd.hex());
        assert_eq!(st["predicate"]["resources"][0]["name"], "model.gguf");
    }

    #[test]
    fn a_tampered_file_is_named() {
        let d = model_dir();
        let k = tempfile::tempdir().unwrap();
        let (sk, vk, _) = keys(k.path());
        sign(d.path(), &sk).unwrap();
        fs::write(d.path().join("tokenizer.json"), b"{\"vocab\":{\"x\":1}}").unwrap();
        match verify_model(d.path(), &vk) {
            Err(VerifyError::Mismatch(diffs)) => {
                assert_eq!(diffs.len(), 1);
                assert!(
                    matches!(&diffs[0], Difference::Changed { name, .. } if name == "tokenizer.json")
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn missing_and_extra_files_are_named() {
        let d = model_dir();
        let k = tempfile::tempdir().unwrap();
        let (sk, vk, _) = keys(k.path());
        sign(d.path(), &sk).unwrap();
        fs::remove_file(d.path().join("extra/config.json")).unwrap();
        fs::write(d.path().join("evil.py"), b"import os").unwrap();
        let e = verify_model(d.path(), &vk).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("extra/config.json: missing"), "{msg}");
        assert!(msg.contains("evil.py: extra"), "{msg}");
    }

    #[test]
    fn wrong_key_fails() {
        let d = model_dir();
        let k = tempfile::tempdir().unwrap();
        let (sk, _, _) = keys(k.path());
        let other = keygen(&k.path().join("other")).unwrap();
        sign(d.path(), &sk).unwrap();
        assert!(matches!(
            verify_model(d.path(), &other),
            Err(VerifyError::BadSignature)
        ));
    }

    #[test]
    fn corrupt_signature_and_altered_manifest_fail() {
        let d = model_dir();
        let k = tempfile::tempdir().unwrap();
        let (sk, vk, _) = keys(k.path());
        let (_, sig_path) = sign(d.path(), &sk).unwrap();
        let original: serde_json::Value =
            serde_json::from_slice(&fs::read(&sig_path).unwrap()).unwrap();
        let b64 = base64::engine::general_purpose::STANDARD;

        // Flip a bit of the signature.
        let mut v = original.clone();
        let mut raw = b64
            .decode(v["dsseEnvelope"]["signatures"][0]["sig"].as_str().unwrap())
            .unwrap();
        raw[10] ^= 1;
        v["dsseEnvelope"]["signatures"][0]["sig"] = b64.encode(&raw).into();
        fs::write(&sig_path, serde_json::to_vec(&v).unwrap()).unwrap();
        assert!(matches!(
            verify_model(d.path(), &vk),
            Err(VerifyError::BadSignature)
        ));

        // Rewrite the manifest to match a tampered file, keeping the old signature.
        let mut v = original.clone();
        let payload = b64
            .decode(v["dsseEnvelope"]["payload"].as_str().unwrap())
            .unwrap();
        let mut st: serde_json::Value = serde_json::from_slice(&payload).unwrap();
        st["predicate"]["resources"][0]["digest"] = "00".repeat(32).into();
        v["dsseEnvelope"]["payload"] = b64.encode(serde_json::to_vec(&st).unwrap()).into();
        fs::write(&sig_path, serde_json::to_vec(&v).unwrap()).unwrap();
        assert!(matches!(
            verify_model(d.path(), &vk),
            Err(VerifyError::BadSignature)
        ));

        // Garbage.
        fs::write(&sig_path, b"not json").unwrap();
        assert!(matches!(
            verify_model(d.path(), &vk),
            Err(VerifyError::Malformed { .. })
        ));
        fs::write(&sig_path, b"{\"dsseEnvelope\": 3}").unwrap();
        assert!(matches!(
            verify_model(d.path(), &vk),
            Err(VerifyError::Malformed { .. })
        ));

        // Gone.
        fs::remove_file(&sig_path).unwrap();
        assert!(matches!(
            verify_model(d.path(), &vk),
            Err(VerifyError::NoSignature(_))
        ));
    }

    #[cfg(unix)]
    #[test]
    fn symlinks_are_refused() {
        let d = model_dir();
        std::os::unix::fs::symlink("/etc/hostname", d.path().join("link")).unwrap();
        assert!(matches!(manifest(d.path()), Err(RegistryError::Symlink(_))));
    }

    #[test]
    fn names_resolve_to_pinned_digests_only() {
        let d = model_dir();
        let digest = manifest(d.path()).unwrap().model_digest();
        let mut reg = ModelRegistry::default();
        reg.models.insert(
            "smol".into(),
            ModelEntry {
                path: d.path().to_path_buf(),
                digest,
            },
        );
        assert_eq!(reg.resolve("smol").unwrap().1.digest, digest);
        assert_eq!(reg.resolve(&format!("smol@{digest}")).unwrap().0, "smol");
        assert_eq!(reg.resolve(&digest.to_string()).unwrap().0, "smol");
        assert!(matches!(
            reg.resolve(&format!("smol@sha256:{}", "0".repeat(64))),
            Err(RegistryError::DigestMismatch { .. })
        ));
        assert!(matches!(
            reg.resolve("other"),
            Err(RegistryError::UnknownModel(_))
        ));
        assert!(matches!(
            reg.resolve("smol@latest"),
            Err(RegistryError::BadDigest(_))
        ));
        assert_eq!(reg.check("smol").unwrap(), digest);
        fs::write(d.path().join("model.gguf"), b"other weights").unwrap();
        assert!(matches!(
            reg.check("smol"),
            Err(RegistryError::DigestMismatch { .. })
        ));
        // A YAML entry without a digest does not parse: names never float.
        assert!(serde_yaml::from_str::<ModelRegistry>("smol:\n  path: /x\n").is_err());
        let yaml = format!("smol:\n  path: /x\n  digest: {digest}\n");
        assert!(serde_yaml::from_str::<ModelRegistry>(&yaml).is_ok());
    }
}
