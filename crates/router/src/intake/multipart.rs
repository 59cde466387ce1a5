//! The `model` field of a `multipart/form-data` body (the audio APIs), found without
//! reading the file parts: only part headers are parsed, the data between them is
//! skipped to the next boundary.

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Option<&str> {
    let mut params = content_type.split(';');
    let kind = params.next()?.trim();
    if !kind.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| v.trim().trim_matches('"'))
            .filter(|b| !b.is_empty())
    })
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    let first = *needle.first()?;
    let mut i = from;
    while let Some(rel) = hay.get(i..)?.iter().position(|&c| c == first) {
        let at = i + rel;
        if hay.get(at..at + needle.len())? == needle {
            return Some(at);
        }
        i = at + 1;
    }
    None
}

/// Whether a part's headers name it `model` (`Content-Disposition: form-data;
/// name="model"`).
fn names_model(headers: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(headers) else {
        return false;
    };
    text.split("\r\n").any(|line| {
        let Some((name, value)) = line.split_once(':') else {
            return false;
        };
        name.trim().eq_ignore_ascii_case("content-disposition")
            && value.split(';').skip(1).any(|p| {
                p.split_once('=').is_some_and(|(k, v)| {
                    k.trim().eq_ignore_ascii_case("name") && v.trim().trim_matches('"') == "model"
                })
            })
    })
}

/// The value of the `model` field, when the body is multipart with one.
pub fn model_field(content_type: &str, body: &[u8]) -> Option<String> {
    let delim = format!("--{}", boundary(content_type)?);
    let next_delim = format!("\r\n{delim}");
    let mut at = find(body, delim.as_bytes(), 0)?;
    loop {
        let start = at + delim.len();
        if body.get(start..start + 2) == Some(b"--") {
            return None;
        }
        let head_end = find(body, b"\r\n\r\n", start)?;
        let value_start = head_end + 4;
        let value_end = find(body, next_delim.as_bytes(), value_start)?;
        if names_model(&body[start..head_end]) {
            let value = std::str::from_utf8(&body[value_start..value_end]).ok()?;
            return Some(value.trim().to_string()).filter(|v| !v.is_empty());
        }
        at = value_end + 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(fields: &[(&str, &str, Option<&str>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value, file) in fields {
            out.extend_from_slice(b"--XyZ\r\n");
            match file {
                Some(f) => out.extend_from_slice(
                    format!("Content-Disposition: form-data; name=\"{name}\"; filename=\"{f}\"\r\nContent-Type: audio/wav\r\n\r\n").as_bytes(),
                ),
                None => out.extend_from_slice(
                    format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
                ),
            }
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"--XyZ--\r\n");
        out
    }

    #[test]
    fn the_model_field_is_found_after_a_file() {
        let ct = "multipart/form-data; boundary=XyZ";
        let body = form(&[
            ("file", "RIFF....--XyZ-not-a-boundary", Some("model")),
            ("language", "en", None),
            ("model", "whisper", None),
        ]);
        assert_eq!(model_field(ct, &body).as_deref(), Some("whisper"));
        let body = form(&[("file", "RIFF", Some("a.wav"))]);
        assert_eq!(model_field(ct, &body), None);
        assert_eq!(model_field("application/json", &body), None);
        assert_eq!(boundary("multipart/form-data; boundary=\"q\""), Some("q"));
    }
}
