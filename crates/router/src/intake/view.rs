//! The routing view of a request body: what the router reads, and nothing else.
//!
//! Read: `model`, `priority`, `cache_salt`, whether `kv_transfer_params` is set, and the
//! prompt as the prefix indexes hash it (chat, Responses and Messages conversations,
//! completion prompts, token ids), with a stable key in place of each non-text part.
//! Every other field, and every field's value beyond its type, is left to the engine:
//! a view tolerates what it does not know, and the body goes upstream byte for byte.
//!
//! The prompt text is the messages as `role\ncontent\n` (text parts joined with `\n`),
//! after any `system` / `instructions` text, kept only up to the prefix window (what the
//! approximate index hashes); its full length is counted for the prefill/decode estimate.
//! A non-text part (an image, audio, a file, a tool call) stands in the text as
//! `<type:hash>`, the hash (xxHash64) taken over its payload: the URL or data of an image
//! (`image_url`, `source`, ...), else the part's whole JSON text. The same image in the
//! same conversation therefore hashes the same, and goes back to the replica that holds
//! its prefix.

use bytes::Bytes;
use xxhash_rust::xxh64::xxh64;

use super::json::{JsonStr, Kind, Scan, Scanner};

/// How a route's body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `messages` (chat completions).
    Chat,
    /// `messages` as a list of conversations (the first one is the prefix).
    ChatBatch,
    /// `prompt` (text, texts, token ids or lists of them).
    Completion,
    /// `instructions` and `input` (OpenAI Responses).
    Responses,
    /// `system` and `messages` (Anthropic Messages).
    Messages,
    /// Only the common fields.
    ModelOnly,
}

/// The `model` field as the body has it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ModelField {
    /// Absent or `null`.
    #[default]
    Missing,
    Named(String),
    /// Present but not a string.
    NotAString,
}

/// What the router reads from one body.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoutingView {
    /// The body is a JSON object (anything else has no fields to read).
    pub object: bool,
    pub model: ModelField,
    /// The body's `priority` when it is an integer that fits.
    pub priority: Option<i32>,
    /// The prompt text for the approximate index (bounded by the prefix window).
    pub prefix_text: String,
    /// The prompt's whole length in bytes (text and part keys), past the window too.
    pub prompt_bytes: usize,
    /// Token ids when the prompt came as ids.
    pub tokens: Option<Vec<u32>>,
    pub salt: Option<String>,
    /// What to send `/tokenize` for token ids, when asked for and the shape allows.
    pub tokenize_body: Option<Bytes>,
    /// The client sent its own `kv_transfer_params` (it runs the protocol itself).
    pub own_kv_transfer: bool,
    /// Those `kv_transfer_params` name a peer (a non-null `remote_host` or `remote_port`):
    /// an engine would connect there.
    pub kv_transfer_names_peer: bool,
    /// Responses: the stored response this one continues.
    pub previous_response_id: Option<String>,
    /// Non-text parts keyed into the prompt text.
    pub parts: usize,
}

/// Whether a `kv_transfer_params` value names a place an engine would connect to: an
/// object with a non-null `remote_host` or `remote_port`. Anything unreadable counts as
/// naming one (it is small, and only a client's own parameters are read).
fn names_peer(value: &[u8]) -> bool {
    match serde_json::from_slice::<serde_json::Value>(value) {
        Ok(serde_json::Value::Object(o)) => ["remote_host", "remote_port"]
            .iter()
            .any(|k| o.get(*k).is_some_and(|v| !v.is_null())),
        Ok(_) => false,
        Err(_) => true,
    }
}

/// What a reader is asked for.
#[derive(Debug, Clone, Copy)]
pub struct ReadLimits {
    /// Bytes of prompt text kept (the approximate index hashes no more).
    pub prefix_window: usize,
    /// Build the `/tokenize` body (a precise prefix scorer is configured).
    pub want_tokenize: bool,
    /// Keep a client's `kv_transfer_params` that name a peer (`pd.trust_client_kv_transfer`).
    pub trust_client_kv_transfer: bool,
}

/// The prompt text as it is built: `head` (system text) and `body` (the conversation or
/// prompt), each bounded by the window, joined at the end.
struct Prompt {
    head: String,
    body: String,
    bytes: usize,
    window: usize,
    parts: usize,
}

impl Prompt {
    fn new(window: usize) -> Prompt {
        Prompt {
            head: String::new(),
            body: String::new(),
            bytes: 0,
            window,
            parts: 0,
        }
    }

    fn push(&mut self, head: bool, s: &str) {
        self.bytes += s.len();
        let window = self.window;
        let out = if head { &mut self.head } else { &mut self.body };
        if out.len() < window {
            let room = window - out.len();
            let mut end = room.min(s.len());
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            out.push_str(&s[..end]);
        }
    }

    fn push_json(&mut self, head: bool, s: &JsonStr<'_>) {
        self.bytes += s.raw().len();
        let window = self.window;
        let out = if head { &mut self.head } else { &mut self.body };
        if out.len() < window {
            s.decode_into(out, window);
        }
    }

    fn push_part(&mut self, head: bool, kind: &str, payload: &[u8]) {
        self.parts += 1;
        let key = format!("<{kind}:{:016x}>", xxh64(payload, 0));
        self.push(head, &key);
    }

    fn finish(mut self) -> (String, usize, usize) {
        if self.head.is_empty() {
            return (self.body, self.bytes, self.parts);
        }
        let room = self.window.saturating_sub(self.head.len());
        let mut end = room.min(self.body.len());
        while !self.body.is_char_boundary(end) {
            end -= 1;
        }
        self.head.push_str(&self.body[..end]);
        (self.head, self.bytes, self.parts)
    }
}

/// Reads the routing view of a JSON body. Fails only when the body is not JSON.
pub fn read_json(shape: Shape, body: &[u8], limits: ReadLimits) -> Scan<RoutingView> {
    let mut s = Scanner::new(body)?;
    let mut view = RoutingView::default();
    if s.kind()? != Kind::Object {
        // JSON, but nothing a router can read: no `model`.
        s.skip()?;
        s.end()?;
        return Ok(view);
    }
    view.object = true;
    let mut prompt = Prompt::new(limits.prefix_window);
    let mut messages_span: Option<&[u8]> = None;
    let mut prompt_span: Option<&[u8]> = None;
    let mut add_generation_prompt: Option<bool> = None;
    let mut add_special_tokens: Option<bool> = None;
    s.object(|s, key| {
        match &*key.decode() {
            "model" => {
                view.model = match s.kind()? {
                    Kind::String => ModelField::Named(s.string()?.decode().into_owned()),
                    Kind::Null => {
                        s.skip()?;
                        ModelField::Missing
                    }
                    _ => {
                        s.skip()?;
                        ModelField::NotAString
                    }
                }
            }
            "priority" => view.priority = s.int_or_skip()?.and_then(|p| i32::try_from(p).ok()),
            "cache_salt" => view.salt = s.str_or_skip()?.map(|v| v.decode().into_owned()),
            "kv_transfer_params" => {
                view.own_kv_transfer = s.kind()? != Kind::Null;
                view.kv_transfer_names_peer = names_peer(s.span()?);
            }
            "add_generation_prompt" => add_generation_prompt = s.bool_or_skip()?,
            "add_special_tokens" => add_special_tokens = s.bool_or_skip()?,
            "messages" if matches!(shape, Shape::Chat | Shape::Messages) => {
                let start = s.offset();
                conversation(s, &mut prompt)?;
                messages_span = Some(s.since(start));
            }
            "messages" if shape == Shape::ChatBatch => batch(s, &mut prompt)?,
            "system" if shape == Shape::Messages => system(s, &mut prompt)?,
            "instructions" if shape == Shape::Responses => system(s, &mut prompt)?,
            "input" if shape == Shape::Responses => match s.kind()? {
                Kind::String => {
                    prompt.push(false, "user\n");
                    let t = s.string()?;
                    prompt.push_json(false, &t);
                    prompt.push(false, "\n");
                }
                Kind::Array => s.array(|s, _| item(s, &mut prompt))?,
                _ => s.skip()?,
            },
            "previous_response_id" if shape == Shape::Responses => {
                view.previous_response_id = s.str_or_skip()?.map(|v| v.decode().into_owned())
            }
            "prompt" if shape == Shape::Completion => {
                let start = s.offset();
                view.tokens = completion_prompt(s, &mut prompt)?;
                prompt_span = Some(s.since(start));
            }
            "prompt_embeds" if shape == Shape::Completion => {
                let span = s.span()?;
                prompt.push_part(false, "prompt_embeds", span);
            }
            _ => s.skip()?,
        }
        Ok(())
    })?;
    s.end()?;
    let (text, bytes, parts) = prompt.finish();
    view.prefix_text = text;
    view.prompt_bytes = bytes;
    view.parts = parts;
    if limits.want_tokenize {
        view.tokenize_body = tokenize_body(
            shape,
            &view,
            messages_span,
            prompt_span,
            add_generation_prompt,
            add_special_tokens,
        );
    }
    Ok(view)
}

/// A message list: `role\ncontent\n` each.
fn conversation(s: &mut Scanner<'_>, prompt: &mut Prompt) -> Scan<()> {
    if s.kind()? != Kind::Array {
        return s.skip();
    }
    s.array(|s, _| item(s, prompt))
}

/// A list of conversations, or one conversation.
fn batch(s: &mut Scanner<'_>, prompt: &mut Prompt) -> Scan<()> {
    if s.kind()? != Kind::Array {
        return s.skip();
    }
    s.array(|s, i| match s.kind()? {
        Kind::Array if i == 0 => conversation(s, prompt),
        Kind::Object => item(s, prompt),
        _ => s.skip(),
    })
}

/// One message (`role` and `content`) or, in a Responses input, any other item (a tool
/// call, its output), which is keyed as a part. The content is written where it goes as it
/// is read; a `role` that comes after it is put in front of it then.
fn item(s: &mut Scanner<'_>, prompt: &mut Prompt) -> Scan<()> {
    if s.kind()? != Kind::Object {
        let span = s.span()?;
        prompt.push_part(false, "item", span);
        return Ok(());
    }
    let start = s.offset();
    let (mark, bytes_before, parts_before) = (prompt.body.len(), prompt.bytes, prompt.parts);
    let mut role: Option<JsonStr<'_>> = None;
    let mut kind: Option<JsonStr<'_>> = None;
    let mut content_seen = false;
    let mut role_written = false;
    s.object(|s, key| {
        match key.raw() {
            b"role" => {
                role = s.str_or_skip()?;
                if let (Some(r), false) = (&role, content_seen) {
                    prompt.push_json(false, r);
                    prompt.push(false, "\n");
                    role_written = true;
                }
            }
            b"type" => kind = s.str_or_skip()?,
            b"content" => {
                content_seen = true;
                content(s, prompt, false)?;
            }
            k if k.contains(&b'\\') => match &*key.decode() {
                "role" => role = s.str_or_skip()?,
                _ => s.skip()?,
            },
            _ => s.skip()?,
        }
        Ok(())
    })?;
    match role {
        Some(role) => {
            if !role_written {
                // The role came after the content: put it in front.
                let head = format!("{}\n", role.decode());
                prompt.bytes += head.len();
                prompt.body.insert_str(mark, &head);
                let mut end = prompt.body.len().min(prompt.window);
                while !prompt.body.is_char_boundary(end) {
                    end -= 1;
                }
                prompt.body.truncate(end);
            }
            prompt.push(false, "\n");
        }
        None => {
            // Not a message: whatever it wrote is replaced by its key.
            prompt.body.truncate(mark);
            prompt.bytes = bytes_before;
            prompt.parts = parts_before;
            let span = s.since(start);
            let kind = kind.map(|k| k.decode());
            prompt.push_part(false, kind.as_deref().unwrap_or("item"), span);
        }
    }
    Ok(())
}

/// System text (`system`, `instructions`): ahead of the conversation, as a system message.
fn system(s: &mut Scanner<'_>, prompt: &mut Prompt) -> Scan<()> {
    prompt.push(true, "system\n");
    content(s, prompt, true)?;
    prompt.push(true, "\n");
    Ok(())
}

/// A content value: a string, or a list of parts (text parts joined with `\n`).
fn content(s: &mut Scanner<'_>, prompt: &mut Prompt, head: bool) -> Scan<()> {
    match s.kind()? {
        Kind::String => {
            let t = s.string()?;
            prompt.push_json(head, &t);
            Ok(())
        }
        Kind::Array => s.array(|s, i| {
            if i > 0 {
                prompt.push(head, "\n");
            }
            part(s, prompt, head)
        }),
        _ => s.skip(),
    }
}

/// Fields whose value is a part's payload: what identifies the image, audio or file.
const PAYLOAD_KEYS: &[&str] = &[
    "image_url",
    "input_audio",
    "audio_url",
    "video_url",
    "file",
    "file_id",
    "file_data",
    "file_url",
    "source",
    "image",
    "image_embeds",
    "audio_embeds",
    "data",
    "url",
];

/// Inside a payload object, the fields that name the content itself (not its options).
const PAYLOAD_LEAVES: &[&str] = &["url", "data", "file_data", "file_id", "file_url"];

/// One content part: text, or a keyed non-text part.
fn part(s: &mut Scanner<'_>, prompt: &mut Prompt, head: bool) -> Scan<()> {
    match s.kind()? {
        Kind::String => {
            let t = s.string()?;
            prompt.push_json(head, &t);
            return Ok(());
        }
        Kind::Object => {}
        _ => {
            let span = s.span()?;
            prompt.push_part(head, "part", span);
            return Ok(());
        }
    }
    let start = s.offset();
    let mut kind: Option<JsonStr<'_>> = None;
    let mut text: Option<JsonStr<'_>> = None;
    let mut payload: Option<&[u8]> = None;
    s.object(|s, key| {
        match &*key.decode() {
            "type" => kind = s.str_or_skip()?,
            "text" => text = s.str_or_skip()?,
            k if payload.is_none() && PAYLOAD_KEYS.contains(&k) => payload = Some(payload_of(s)?),
            _ => s.skip()?,
        }
        Ok(())
    })?;
    let kind_name = kind.map(|k| k.decode());
    let is_text = matches!(
        kind_name.as_deref(),
        None | Some("text" | "input_text" | "output_text")
    );
    match text {
        Some(t) if is_text => prompt.push_json(head, &t),
        _ => {
            let whole = s.since(start);
            prompt.push_part(
                head,
                kind_name.as_deref().unwrap_or("part"),
                payload.unwrap_or(whole),
            );
        }
    }
    Ok(())
}

/// A payload value's identifying text: a string as it is, or an object's first `url`,
/// `data` or file field, else the whole value.
fn payload_of<'a>(s: &mut Scanner<'a>) -> Scan<&'a [u8]> {
    match s.kind()? {
        Kind::String => Ok(s.string()?.raw()),
        Kind::Object => {
            let start = s.offset();
            let mut leaf: Option<&'a [u8]> = None;
            s.object(|s, key| {
                match &*key.decode() {
                    k if leaf.is_none() && PAYLOAD_LEAVES.contains(&k) => {
                        leaf = s.str_or_skip()?.map(|v| v.raw())
                    }
                    _ => s.skip()?,
                }
                Ok(())
            })?;
            Ok(leaf.unwrap_or_else(|| s.since(start)))
        }
        _ => s.span(),
    }
}

/// A completion `prompt`: text, texts, token ids, or lists of token ids. The first prompt
/// of a batch is the one routed on. Returns the token ids when the prompt is ids.
fn completion_prompt(s: &mut Scanner<'_>, prompt: &mut Prompt) -> Scan<Option<Vec<u32>>> {
    match s.kind()? {
        Kind::String => {
            let t = s.string()?;
            prompt.push_json(false, &t);
            Ok(None)
        }
        Kind::Array => {
            // The first element says which form the prompt has.
            let mut first: Option<Kind> = None;
            let mut ids: Vec<u32> = Vec::new();
            let mut all_ids = true;
            let mut listed: Option<Vec<u32>> = None;
            s.array(|s, i| {
                let k = s.kind()?;
                if i == 0 {
                    first = Some(k);
                }
                match (first, k) {
                    (Some(Kind::Number), Kind::Number) => {
                        match s.number()?.parse::<u32>() {
                            Ok(id) if all_ids => ids.push(id),
                            _ => all_ids = false,
                        }
                        Ok(())
                    }
                    (Some(Kind::Number), _) => {
                        all_ids = false;
                        s.skip()
                    }
                    (Some(Kind::String), Kind::String) if i == 0 => {
                        let t = s.string()?;
                        prompt.push_json(false, &t);
                        Ok(())
                    }
                    (Some(Kind::Array), Kind::Array) if i == 0 => {
                        listed = token_list(s)?;
                        Ok(())
                    }
                    _ => s.skip(),
                }
            })?;
            let tokens = match first {
                Some(Kind::Number) if all_ids => Some(ids),
                _ => listed,
            };
            if let Some(ids) = &tokens {
                let mut text = String::with_capacity(ids.len().min(prompt.window) * 6);
                for id in ids {
                    if text.len() >= prompt.window {
                        break;
                    }
                    text.push_str(&id.to_string());
                    text.push(' ');
                }
                prompt.push(false, &text);
            }
            Ok(tokens)
        }
        _ => {
            s.skip()?;
            Ok(None)
        }
    }
}

/// A list of token ids; `None` when an element is not one.
fn token_list(s: &mut Scanner<'_>) -> Scan<Option<Vec<u32>>> {
    let mut ids = Some(Vec::new());
    s.array(|s, _| {
        if s.kind()? == Kind::Number {
            let n = s.number()?;
            match (n.parse::<u32>(), ids.as_mut()) {
                (Ok(id), Some(v)) => v.push(id),
                _ => ids = None,
            }
            Ok(())
        } else {
            ids = None;
            s.skip()
        }
    })?;
    Ok(ids.filter(|v| !v.is_empty()))
}

/// The `/tokenize` body for the engine's own token ids of this prompt (chat messages, or
/// a text completion prompt), built from the request's own JSON text.
fn tokenize_body(
    shape: Shape,
    view: &RoutingView,
    messages: Option<&[u8]>,
    prompt: Option<&[u8]>,
    add_generation_prompt: Option<bool>,
    add_special_tokens: Option<bool>,
) -> Option<Bytes> {
    let model = match &view.model {
        ModelField::Named(m) => serde_json::to_string(m).ok()?,
        _ => "null".to_string(),
    };
    let join = |key: &str, value: &[u8], flag: &str, on: bool| {
        let mut out = Vec::with_capacity(value.len() + 96);
        out.extend_from_slice(b"{\"model\":");
        out.extend_from_slice(model.as_bytes());
        out.extend_from_slice(format!(",\"{key}\":").as_bytes());
        out.extend_from_slice(value);
        out.extend_from_slice(format!(",\"{flag}\":{on}}}").as_bytes());
        Bytes::from(out)
    };
    match shape {
        Shape::Chat => Some(join(
            "messages",
            messages?,
            "add_generation_prompt",
            add_generation_prompt.unwrap_or(true),
        )),
        Shape::Completion if view.tokens.is_none() => {
            let p = prompt?;
            (p.trim_ascii_start().first() == Some(&b'"')).then(|| {
                join(
                    "prompt",
                    p,
                    "add_special_tokens",
                    add_special_tokens.unwrap_or(true),
                )
            })
        }
        _ => None,
    }
}
