//! The audio routes' bodies: `multipart/form-data` (OpenAI's and vLLM's
//! `/v1/audio/transcriptions` and `/v1/audio/translations`), read only as far as the
//! gateway needs. The text fields (`model`, `prompt`, `language`, ...) become the JSON
//! object the other stages read; the body itself is forwarded as sent (the `file` part
//! untouched), with only its `model` field's value replaced when a target names another
//! model.
//!
//! The boundary is the body's first line (`--<boundary>`), the one the client's
//! `Content-Type` names and the upstream receives with it.

use axum::body::Bytes;
use memchr::memmem;
use serde_json::{Map, Value};

/// Longest text field read (the file part is never read as text).
const MAX_FIELD_BYTES: usize = 64 * 1024;

/// Why a body is not a form the audio routes take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormError {
    #[error("The body must be multipart/form-data (it does not start with a boundary line).")]
    NoBoundary,
    #[error("The multipart body is cut short or malformed.")]
    Malformed,
    #[error("A multipart part has no `Content-Disposition: form-data` name.")]
    NoName,
    #[error("The form field `{0}` is not UTF-8 text or is too long.")]
    BadField(String),
    #[error("The form has no `file` part.")]
    NoFile,
}

/// One part: its name, whether it is a file, and where its content lies in the body.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Part {
    name: String,
    file: bool,
    start: usize,
    end: usize,
}

/// Every part of `body`, in order.
fn parts(body: &[u8]) -> Result<Vec<Part>, FormError> {
    let first_end = memmem::find(body, b"\r\n").ok_or(FormError::NoBoundary)?;
    let first = &body[..first_end];
    if first.len() < 3 || !first.starts_with(b"--") {
        return Err(FormError::NoBoundary);
    }
    let mut delimiter = b"\r\n".to_vec();
    delimiter.extend_from_slice(first);
    let finder = memmem::Finder::new(&delimiter);
    let mut out = Vec::new();
    let mut at = first_end + 2;
    loop {
        let head_end = memmem::find(&body[at..], b"\r\n\r\n").ok_or(FormError::Malformed)? + at;
        let (name, file) = disposition(&body[at..head_end])?;
        let start = head_end + 4;
        let end = finder.find(&body[start..]).ok_or(FormError::Malformed)? + start;
        out.push(Part {
            name,
            file,
            start,
            end,
        });
        let after = end + delimiter.len();
        match body.get(after..after + 2) {
            Some(b"--") => return Ok(out),
            Some(b"\r\n") => at = after + 2,
            _ => return Err(FormError::Malformed),
        }
    }
}

/// The `name` of a part's `Content-Disposition: form-data` header, and whether it names a
/// `filename`.
fn disposition(headers: &[u8]) -> Result<(String, bool), FormError> {
    let text = String::from_utf8_lossy(headers);
    for line in text.split("\r\n") {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        if !key.trim().eq_ignore_ascii_case("content-disposition") {
            continue;
        }
        let mut name = None;
        let mut file = false;
        for param in value.split(';').skip(1) {
            let Some((k, v)) = param.split_once('=') else {
                continue;
            };
            let v = v.trim().trim_matches('"');
            match k.trim().to_ascii_lowercase().as_str() {
                "name" => name = Some(v.to_string()),
                "filename" => file = true,
                _ => {}
            }
        }
        return name
            .filter(|n| !n.is_empty())
            .map(|n| (n, file))
            .ok_or(FormError::NoName);
    }
    Err(FormError::NoName)
}

/// The text fields of a form as a JSON object (each a string; a repeated name keeps its
/// last value); a form without a `file` part is refused.
pub(crate) fn fields(body: &[u8]) -> Result<Value, FormError> {
    let mut out = Map::new();
    let mut has_file = false;
    for p in parts(body)? {
        if p.file {
            has_file |= p.name == "file";
            continue;
        }
        let raw = &body[p.start..p.end];
        let text = (raw.len() <= MAX_FIELD_BYTES)
            .then(|| std::str::from_utf8(raw).ok())
            .flatten()
            .ok_or_else(|| FormError::BadField(p.name.clone()))?;
        out.insert(p.name, Value::String(text.to_string()));
    }
    if !has_file {
        return Err(FormError::NoFile);
    }
    Ok(Value::Object(out))
}

/// The body with its `model` field's value replaced (the rest byte for byte); `None`
/// when it has no `model` field.
pub(crate) fn with_model(body: &Bytes, model: &str) -> Option<Bytes> {
    let parts = parts(body).ok()?;
    let p = parts.iter().find(|p| p.name == "model" && !p.file)?;
    let mut out = Vec::with_capacity(body.len() + model.len());
    out.extend_from_slice(&body[..p.start]);
    out.extend_from_slice(model.as_bytes());
    out.extend_from_slice(&body[p.end..]);
    Some(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(model: &str) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n");
        b.extend_from_slice(model.as_bytes());
        b.extend_from_slice(b"\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n");
        b.extend_from_slice(b"RIFF\0\x01\r\n--X\xff");
        b.extend_from_slice(
            b"\r\n--XyZ\r\ncontent-disposition: form-data; name=language\r\n\r\nen\r\n--XyZ--\r\n",
        );
        b
    }

    #[test]
    fn text_fields_are_read_and_the_file_is_not() {
        let v = fields(&form("whisper")).unwrap();
        assert_eq!(v, serde_json::json!({"model": "whisper", "language": "en"}));
    }

    #[test]
    fn the_model_is_replaced_and_the_rest_kept_byte_for_byte() {
        let body = Bytes::from(form("whisper"));
        let out = with_model(&body, "large-v3").unwrap();
        assert_eq!(out, Bytes::from(form("large-v3")));
        assert_eq!(fields(&out).unwrap()["model"], "large-v3");
    }

    #[test]
    fn bad_forms_are_refused() {
        assert_eq!(fields(b"{\"model\": \"m\"}"), Err(FormError::NoBoundary));
        let mut cut = form("m");
        cut.truncate(60);
        assert_eq!(fields(&cut), Err(FormError::Malformed));
        let no_file =
            b"--B\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--B--\r\n";
        assert_eq!(fields(no_file), Err(FormError::NoFile));
        let no_name = b"--B\r\nContent-Disposition: form-data\r\n\r\nm\r\n--B--\r\n";
        assert_eq!(fields(no_name), Err(FormError::NoName));
        let binary =
            b"--B\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\n\xff\xfe\r\n--B--\r\n";
        assert_eq!(fields(binary), Err(FormError::BadField("prompt".into())));
    }
}
