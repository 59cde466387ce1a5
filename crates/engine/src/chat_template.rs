//! Chat templates: the Jinja template a model ships in `tokenizer.chat_template`,
//! rendered with minijinja the way Hugging Face `transformers` renders it.
//!
//! HF semantics reproduced here:
//! * `trim_blocks` and `lstrip_blocks` on, trailing newline of the template dropped;
//! * variables `messages` (list of `{role, content}` in that key order),
//!   `add_generation_prompt`, `bos_token`, `eos_token`;
//! * `raise_exception(msg)` fails the render with [`TemplateError::Raised`];
//! * `tojson` behaves like Python's `json.dumps` (`", "`/`": "` separators, non-ASCII
//!   kept, no HTML escaping; `indent`, `ensure_ascii`, `sort_keys` keywords);
//! * Python string/dict methods used by common templates: `strip`, `lstrip`, `rstrip`,
//!   `startswith`, `endswith`, `split`, `rsplit`, `upper`, `lower`, `title`,
//!   `capitalize`, `replace`, `find`, `count`, `join`, `removeprefix`,
//!   `removesuffix`, `isdigit`, `isalpha`, `isalnum`, `isspace`, `islower`,
//!   `isupper`; `items`, `keys`, `values`, `get`.
//!
//! Models without a template get ChatML.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use candle_core::quantized::gguf_file::{Content, Value as GgufValue};
use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::{Deserialize, Serialize};

/// ChatML, used when a model has no template of its own.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's calls (OpenAI's shape), for templates that render them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The participant's (or tool's) name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// What a render may add besides the messages: the request's `tools` (the template's
/// `tools` variable) and `chat_template_kwargs` (each key a variable).
#[derive(Debug, Clone, Default)]
pub struct RenderExtras {
    pub tools: Option<serde_json::Value>,
    pub kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Errors from compiling or rendering a chat template.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The template does not compile.
    #[error("chat template syntax error: {0}")]
    Syntax(String),
    /// The template called `raise_exception(message)`.
    #[error("chat template raised an exception: {0}")]
    Raised(String),
    /// Any other failure while rendering.
    #[error("chat template render error: {0}")]
    Render(String),
    /// `tokenizer.chat_template` exists but is not a string.
    #[error("GGUF metadata `tokenizer.chat_template` is not a string")]
    BadMetadata,
}

/// The error a `raise_exception` call attaches, to tell it apart from other errors.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

/// A compiled chat template. `Send + Sync`; render from any thread.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    fallback: bool,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the texts the template sees.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, TemplateError> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(python_method);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson_filter);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| TemplateError::Syntax(describe(&e)))?;
        Ok(Self {
            env,
            source,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            fallback: false,
        })
    }

    /// The ChatML fallback template.
    pub fn chatml(bos_token: impl Into<String>, eos_token: impl Into<String>) -> Self {
        match Self::new(CHATML_TEMPLATE, bos_token, eos_token) {
            Ok(mut t) => {
                t.fallback = true;
                t
            }
            // The built-in template is a constant that compiles; a failure here is a
            // programming error caught by the tests.
            Err(e) => unreachable!("built-in ChatML template failed to compile: {e}"),
        }
    }

    /// The template of a GGUF file (`tokenizer.chat_template`), or ChatML when absent.
    pub fn from_gguf(content: &Content) -> Result<Self, TemplateError> {
        Self::from_metadata(&content.metadata)
    }

    /// Like [`ChatTemplate::from_gguf`], from the metadata map. `bos_token` and
    /// `eos_token` are the texts of `tokenizer.ggml.bos_token_id`/`eos_token_id`
    /// (empty when absent).
    pub fn from_metadata(metadata: &HashMap<String, GgufValue>) -> Result<Self, TemplateError> {
        let token_text = |key: &str| -> String {
            let id = match metadata.get(key) {
                Some(GgufValue::U32(i)) => Some(u64::from(*i)),
                Some(GgufValue::I32(i)) => u64::try_from(*i).ok(),
                Some(GgufValue::U64(i)) => Some(*i),
                Some(GgufValue::I64(i)) => u64::try_from(*i).ok(),
                _ => None,
            };
            let tokens = match metadata.get("tokenizer.ggml.tokens") {
                Some(GgufValue::Array(a)) => a.as_slice(),
                _ => &[],
            };
            match id
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| tokens.get(i))
            {
                Some(GgufValue::String(s)) => s.clone(),
                _ => String::new(),
            }
        };
        let bos = token_text("tokenizer.ggml.bos_token_id");
        let eos = token_text("tokenizer.ggml.eos_token_id");
        match metadata.get("tokenizer.chat_template") {
            None => Ok(Self::chatml(bos, eos)),
            Some(GgufValue::String(src)) => Self::new(src.clone(), bos, eos),
            Some(_) => Err(TemplateError::BadMetadata),
        }
    }

    /// The template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether this is the ChatML fallback rather than the model's own template.
    pub fn is_fallback(&self) -> bool {
        self.fallback
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders `messages`; with `add_generation_prompt` the prompt ends where the
    /// assistant's reply starts.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, add_generation_prompt, &RenderExtras::default())
    }

    /// [`Self::render`] with the request's tools and extra variables. A kwarg never
    /// replaces `messages`, `tools`, `add_generation_prompt` or the special tokens.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extras: &RenderExtras,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Render(describe(&e)))?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| Value::from_object(MessageValue(m.clone())))
            .collect();
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            tools => extras.tools.as_ref().map(Value::from_serialize),
        };
        let ctx = match &extras.kwargs {
            Some(kwargs) => minijinja::context! { ..ctx, ..Value::from_serialize(kwargs) },
            None => ctx,
        };
        template.render(ctx).map_err(|e| classify(&e))
    }
}

fn describe(e: &Error) -> String {
    e.to_string()
}

fn classify(e: &Error) -> TemplateError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = src {
        if let Some(r) = s.downcast_ref::<RaisedException>() {
            return TemplateError::Raised(r.0.clone());
        }
        src = s.source();
    }
    match e.kind() {
        ErrorKind::SyntaxError => TemplateError::Syntax(describe(e)),
        _ => TemplateError::Render(describe(e)),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedException(message)))
}

/// A message as the template sees it: a map with keys `role`, `content` in that order.
#[derive(Debug)]
struct MessageValue(ChatMessage);

impl Object for MessageValue {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let m = &self.0;
        match key.as_str()? {
            "role" => Some(Value::from(m.role.as_str())),
            "content" => Some(Value::from(m.content.as_str())),
            "tool_calls" => m.tool_calls.as_ref().map(tool_calls_value),
            "tool_call_id" => m.tool_call_id.as_deref().map(Value::from),
            "name" => m.name.as_deref().map(Value::from),
            _ => None,
        }
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        let m = &self.0;
        match (&m.tool_calls, &m.tool_call_id, &m.name) {
            (None, None, None) => Enumerator::Str(&["role", "content"]),
            _ => {
                let mut keys = vec![Value::from("role"), Value::from("content")];
                for (k, present) in [
                    ("tool_calls", m.tool_calls.is_some()),
                    ("tool_call_id", m.tool_call_id.is_some()),
                    ("name", m.name.is_some()),
                ] {
                    if present {
                        keys.push(Value::from(k));
                    }
                }
                Enumerator::Values(keys)
            }
        }
    }
}

/// An assistant message's `tool_calls` as templates expect them: each call's
/// `function.arguments` an object (HF's convention) when the wire gave a JSON string.
fn tool_calls_value(calls: &serde_json::Value) -> Value {
    let mut calls = calls.clone();
    if let Some(list) = calls.as_array_mut() {
        for call in list {
            let parsed = call
                .pointer("/function/arguments")
                .and_then(serde_json::Value::as_str)
                .and_then(|a| serde_json::from_str::<serde_json::Value>(a).ok());
            if let (Some(args), Some(f)) = (parsed, call.get_mut("function")) {
                f["arguments"] = args;
            }
        }
    }
    Value::from_serialize(&calls)
}

// ---------------------------------------------------------------------------
// Python compatibility

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

fn str_arg(args: &[Value], i: usize, method: &str) -> Result<Option<String>, Error> {
    match args.get(i) {
        None => Ok(None),
        Some(v) if v.is_none() || v.is_undefined() => Ok(None),
        Some(v) => v
            .as_str()
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| invalid(format!("{method}() expects a string argument"))),
    }
}

fn int_arg(args: &[Value], i: usize, method: &str) -> Result<Option<i64>, Error> {
    match args.get(i) {
        None => Ok(None),
        Some(v) if v.is_none() || v.is_undefined() => Ok(None),
        Some(v) => i64::try_from(v.clone())
            .map(Some)
            .map_err(|_| invalid(format!("{method}() expects an integer argument"))),
    }
}

fn max_args(args: &[Value], n: usize, method: &str) -> Result<(), Error> {
    if args.len() > n {
        Err(Error::new(
            ErrorKind::TooManyArguments,
            format!("{method}() takes at most {n} arguments"),
        ))
    } else {
        Ok(())
    }
}

fn strip_with<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let pred = |c: char| match chars {
        Some(set) => set.contains(c),
        None => c.is_whitespace(),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(pred);
    }
    if right {
        out = out.trim_end_matches(pred);
    }
    out
}

/// Python's `str.split` (and `rsplit` with `reverse`).
fn py_split(s: &str, sep: Option<&str>, maxsplit: Option<i64>, reverse: bool) -> Vec<String> {
    let limit = maxsplit.filter(|&m| m >= 0).map(|m| m as usize);
    match sep {
        Some(sep) => {
            let parts: Vec<&str> = match (limit, reverse) {
                (Some(m), false) => s.splitn(m + 1, sep).collect(),
                (Some(m), true) => {
                    let mut v: Vec<&str> = s.rsplitn(m + 1, sep).collect();
                    v.reverse();
                    v
                }
                (None, _) => s.split(sep).collect(),
            };
            parts.into_iter().map(str::to_string).collect()
        }
        None => {
            // Runs of whitespace separate; no empty strings; maxsplit leaves the rest
            // (with its leading whitespace stripped) as the last element.
            let mut out = Vec::new();
            if reverse {
                let mut rest = s.trim_end();
                while !rest.is_empty() {
                    if limit.is_some_and(|m| out.len() == m) {
                        out.push(rest.to_string());
                        break;
                    }
                    match rest.rfind(char::is_whitespace) {
                        Some(pos) => {
                            let ws_len = rest[pos..].chars().next().map_or(1, char::len_utf8);
                            out.push(rest[pos + ws_len..].to_string());
                            rest = rest[..pos].trim_end();
                        }
                        None => {
                            out.push(rest.to_string());
                            break;
                        }
                    }
                }
                out.reverse();
            } else {
                let mut rest = s.trim_start();
                while !rest.is_empty() {
                    if limit.is_some_and(|m| out.len() == m) {
                        out.push(rest.to_string());
                        break;
                    }
                    match rest.find(char::is_whitespace) {
                        Some(pos) => {
                            out.push(rest[..pos].to_string());
                            rest = rest[pos..].trim_start();
                        }
                        None => {
                            out.push(rest.to_string());
                            break;
                        }
                    }
                }
            }
            out
        }
    }
}

fn py_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_cased = false;
    for c in s.chars() {
        if prev_cased {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        prev_cased = c.is_alphabetic();
    }
    out
}

fn py_capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(first) => first
            .to_uppercase()
            .chain(chars.flat_map(char::to_lowercase))
            .collect(),
        None => String::new(),
    }
}

/// `startswith`/`endswith` take a string or a tuple/list of strings.
fn affix_matches(s: &str, arg: &Value, method: &str, prefix: bool) -> Result<bool, Error> {
    let test = |p: &str| {
        if prefix {
            s.starts_with(p)
        } else {
            s.ends_with(p)
        }
    };
    if let Some(p) = arg.as_str() {
        return Ok(test(p));
    }
    if arg.kind() == ValueKind::Seq {
        for item in arg.try_iter()? {
            let p = item
                .as_str()
                .ok_or_else(|| invalid(format!("{method}() expects strings")))?;
            if test(p) {
                return Ok(true);
            }
        }
        return Ok(false);
    }
    Err(invalid(format!("{method}() expects a string or a tuple")))
}

/// Python's `str` methods, one function per group; any other is `UnknownMethod`.
fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    match method {
        "strip" | "lstrip" | "rstrip" | "startswith" | "endswith" | "removeprefix"
        | "removesuffix" => affix_method(s, method, args),
        "split" | "rsplit" | "join" => split_method(s, method, args),
        "replace" | "find" | "count" => search_method(s, method, args),
        "upper" | "lower" | "title" | "capitalize" => Ok(case_method(s, method)),
        "isdigit" | "isalpha" | "isalnum" | "isspace" | "islower" | "isupper" => {
            Ok(Value::from(class_test(s, method)))
        }
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

/// `strip`, `lstrip`, `rstrip`, `startswith`, `endswith`, `removeprefix`, `removesuffix`:
/// what is at the ends of `s`.
fn affix_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    Ok(match method {
        "strip" | "lstrip" | "rstrip" => {
            max_args(args, 1, method)?;
            let chars = str_arg(args, 0, method)?;
            let (l, r) = match method {
                "strip" => (true, true),
                "lstrip" => (true, false),
                _ => (false, true),
            };
            Value::from(strip_with(s, chars.as_deref(), l, r))
        }
        "startswith" | "endswith" => {
            let arg = args
                .first()
                .ok_or_else(|| Error::new(ErrorKind::MissingArgument, method.to_string()))?;
            max_args(args, 1, method)?;
            Value::from(affix_matches(s, arg, method, method == "startswith")?)
        }
        // `removeprefix` or `removesuffix`.
        _ => {
            max_args(args, 1, method)?;
            let affix = str_arg(args, 0, method)?.unwrap_or_default();
            let out = if method == "removeprefix" {
                s.strip_prefix(affix.as_str()).unwrap_or(s)
            } else {
                s.strip_suffix(affix.as_str()).unwrap_or(s)
            };
            Value::from(out)
        }
    })
}

/// `split`, `rsplit` and `join`: `s` cut into a list, or a list glued with `s`.
fn split_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    if method == "join" {
        max_args(args, 1, method)?;
        let items = args
            .first()
            .ok_or_else(|| Error::new(ErrorKind::MissingArgument, "join() iterable"))?;
        let mut out = String::new();
        for (i, item) in items.try_iter()?.enumerate() {
            if i > 0 {
                out.push_str(s);
            }
            let piece = item
                .as_str()
                .ok_or_else(|| invalid("join() expects strings"))?;
            out.push_str(piece);
        }
        return Ok(Value::from(out));
    }
    max_args(args, 2, method)?;
    let sep = str_arg(args, 0, method)?;
    if sep.as_deref() == Some("") {
        return Err(invalid("empty separator"));
    }
    let maxsplit = int_arg(args, 1, method)?;
    let parts = py_split(s, sep.as_deref(), maxsplit, method == "rsplit");
    Ok(Value::from(parts))
}

/// `replace`, `find` and `count`: a substring's occurrences in `s`.
fn search_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    Ok(match method {
        "replace" => {
            max_args(args, 3, method)?;
            let old = str_arg(args, 0, method)?
                .ok_or_else(|| Error::new(ErrorKind::MissingArgument, "replace() old"))?;
            let new = str_arg(args, 1, method)?
                .ok_or_else(|| Error::new(ErrorKind::MissingArgument, "replace() new"))?;
            match int_arg(args, 2, method)? {
                Some(n) if n >= 0 => Value::from(s.replacen(&old, &new, n as usize)),
                _ => Value::from(s.replace(&old, &new)),
            }
        }
        "find" => {
            max_args(args, 1, method)?;
            let sub = str_arg(args, 0, method)?
                .ok_or_else(|| Error::new(ErrorKind::MissingArgument, "find() sub"))?;
            // Python returns a character index.
            match s.find(&sub) {
                Some(byte_pos) => Value::from(s[..byte_pos].chars().count() as i64),
                None => Value::from(-1i64),
            }
        }
        // `count`.
        _ => {
            max_args(args, 1, method)?;
            let sub = str_arg(args, 0, method)?
                .ok_or_else(|| Error::new(ErrorKind::MissingArgument, "count() sub"))?;
            if sub.is_empty() {
                Value::from(s.chars().count() as i64 + 1)
            } else {
                Value::from(s.matches(sub.as_str()).count() as i64)
            }
        }
    })
}

/// `upper`, `lower`, `title` and `capitalize` (they take no argument; any given is ignored).
fn case_method(s: &str, method: &str) -> Value {
    Value::from(match method {
        "upper" => s.to_uppercase(),
        "lower" => s.to_lowercase(),
        "title" => py_title(s),
        // `capitalize`.
        _ => py_capitalize(s),
    })
}

/// `isdigit`, `isalpha`, `isalnum`, `isspace`, `islower` and `isupper`, as Python answers
/// them (false for an empty string).
fn class_test(s: &str, method: &str) -> bool {
    let all = |f: fn(char) -> bool| !s.is_empty() && s.chars().all(f);
    match method {
        "isdigit" => all(|c| c.is_numeric()),
        "isalpha" => all(char::is_alphabetic),
        "isalnum" => all(char::is_alphanumeric),
        "isspace" => all(char::is_whitespace),
        "islower" => s.chars().any(char::is_lowercase) && !s.chars().any(char::is_uppercase),
        // `isupper`.
        _ => s.chars().any(char::is_uppercase) && !s.chars().any(char::is_lowercase),
    }
}

fn map_method(value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    Ok(match method {
        "items" => {
            max_args(args, 0, method)?;
            let mut out = Vec::new();
            for key in value.try_iter()? {
                let v = value.get_item(&key)?;
                out.push(Value::from(vec![key, v]));
            }
            Value::from(out)
        }
        "keys" => {
            max_args(args, 0, method)?;
            Value::from(value.try_iter()?.collect::<Vec<_>>())
        }
        "values" => {
            max_args(args, 0, method)?;
            let mut out = Vec::new();
            for key in value.try_iter()? {
                out.push(value.get_item(&key)?);
            }
            Value::from(out)
        }
        "get" => {
            max_args(args, 2, method)?;
            let key = args
                .first()
                .ok_or_else(|| Error::new(ErrorKind::MissingArgument, "get() key"))?;
            let v = value.get_item(key)?;
            if v.is_undefined() {
                args.get(1).cloned().unwrap_or(Value::from(()))
            } else {
                v
            }
        }
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

fn python_method(
    _state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        return string_method(s, method, args);
    }
    if value.kind() == ValueKind::Map {
        return map_method(value, method, args);
    }
    Err(Error::from(ErrorKind::UnknownMethod))
}

// ---------------------------------------------------------------------------
// tojson, Python style

struct JsonStyle {
    indent: Option<String>,
    ensure_ascii: bool,
    sort_keys: bool,
}

fn tojson_filter(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v)
                    .map_err(|_| invalid("tojson(): indent must be an integer or a string"))?;
                Some(" ".repeat(n.max(0) as usize))
            }
        },
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        indent,
        ensure_ascii,
        sort_keys,
    };
    let mut out = String::new();
    write_json(value, &style, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's float repr: always a decimal point or exponent (`1.0`, `1e+20`).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        let s = format!("{f:e}");
        // Rust: 1e20 / 1.5e-7; Python: 1e+20 / 1.5e-07.
        let (mant, exp) = s.split_once('e').unwrap_or((s.as_str(), "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mant}e{sign}{digits:0>2}");
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

fn write_json(v: &Value, style: &JsonStyle, depth: usize, out: &mut String) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &style.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    let item_sep = if style.indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                let _ = write!(out, "{v}");
            } else {
                match f64::try_from(v.clone()) {
                    Ok(f) => out.push_str(&python_float(f)),
                    Err(_) => {
                        let _ = write!(out, "{v}");
                    }
                }
            }
        }
        ValueKind::String => {
            write_json_str(v.as_str().unwrap_or_default(), style.ensure_ascii, out)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(item, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(k) => write_json_str(k, style.ensure_ascii, out),
                    None => write_json_str(&key.to_string(), style.ensure_ascii, out),
                }
                out.push_str(": ");
                write_json(&v.get_item(key)?, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => write_json_str(&v.to_string(), style.ensure_ascii, out),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render_src(src: &str) -> Result<String, TemplateError> {
        ChatTemplate::new(src, "<s>", "</s>")?.render(&[ChatMessage::user("hi")], false)
    }

    #[test]
    fn python_string_methods() {
        let out = render_src(
            "{{ '  a b  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '  a'.lstrip() }}|\
             {{ 'a  '.rstrip() }}|{{ 'hello'.startswith('he') }}|\
             {{ 'hello'.endswith(('x', 'lo')) }}|{{ 'a,b,,c'.split(',') }}|\
             {{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a b c'.rsplit(' ', 1) }}|\
             {{ 'Ab'.upper() }}{{ 'Ab'.lower() }}|{{ 'hello world'.title() }}|\
             {{ 'hELLO'.capitalize() }}|{{ 'aaa'.replace('a', 'b', 2) }}|\
             {{ 'héllo'.find('l') }}|{{ 'a-b-c'.count('-') }}|{{ '-'.join(['x', 'y']) }}|\
             {{ 'think</think>answer'.split('</think>')[-1] }}|{{ '123'.isdigit() }}",
        )
        .expect("render");
        assert_eq!(
            out,
            "a b|a|a|a|True|True|[\"a\", \"b\", \"\", \"c\"]|[\"a\", \"b\"]|\
             [\"a\", \"b c\"]|[\"a b\", \"c\"]|ABab|Hello World|Hello|bba|2|2|x-y|answer|True"
        );
    }

    #[test]
    fn python_dict_methods_and_message_order() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v }};{% endfor %}\
             {{ m.get('missing', 'dflt') }}|{{ m.get('role') }}|{{ m.keys() | list }}\
             {{ m | tojson }}{% endfor %}",
            "",
            "",
        )
        .expect("compile");
        let out = t
            .render(&[ChatMessage::user("é \"q\"\n")], false)
            .expect("render");
        assert_eq!(
            out,
            "role=user;content=é \"q\"\n;dflt|user|[\"role\", \"content\"]\
             {\"role\": \"user\", \"content\": \"é \\\"q\\\"\\n\"}"
        );
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let out = render_src(
            "{{ {'a': [1, 2.5, none, true], 'b': 'x<y'} | tojson }}|{{ [] | tojson }}|\
             {{ {'k': [1, {'z': 2}]} | tojson(indent=2) }}|{{ 'é' | tojson(ensure_ascii=true) }}|\
             {{ 1.0 | tojson }}",
        )
        .expect("render");
        assert_eq!(
            out,
            "{\"a\": [1, 2.5, null, true], \"b\": \"x<y\"}|[]|\
             {\n  \"k\": [\n    1,\n    {\n      \"z\": 2\n    }\n  ]\n}|\"\\u00e9\"|1.0"
        );
    }

    #[test]
    fn shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
        assert_send_sync::<TemplateError>();
    }

    #[test]
    fn python_float_repr() {
        assert_eq!(python_float(0.1), "0.1");
        assert_eq!(python_float(2.0), "2.0");
        assert_eq!(python_float(1e20), "1e+20");
        assert_eq!(python_float(1.5e-7), "1.5e-07");
    }

    #[test]
    fn trim_and_lstrip_blocks() {
        let out = ChatTemplate::new(
            "{% for m in messages %}\n    {% if true %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n",
            "",
            "",
        )
        .expect("compile")
        .render(&[ChatMessage::user("a"), ChatMessage::user("b")], false)
        .expect("render");
        assert_eq!(out, "[a]\n[b]\n");
    }

    #[test]
    fn errors_are_typed() {
        assert!(matches!(
            render_src("{{ raise_exception('no system role') }}"),
            Err(TemplateError::Raised(m)) if m == "no system role"
        ));
        assert!(matches!(
            ChatTemplate::new("{% for m in messages %}", "", ""),
            Err(TemplateError::Syntax(_))
        ));
        assert!(matches!(
            render_src("{{ 'a'.nosuchmethod() }}"),
            Err(TemplateError::Render(_))
        ));
    }

    #[test]
    fn tools_kwargs_and_tool_messages_reach_the_template() {
        let t = ChatTemplate::new(
            "{% if tools %}T:{{ tools | map(attribute='function') | map(attribute='name') | join(',') }};{% endif %}\
             {% for m in messages %}{{ m.role }}:{{ m.content }}\
             {% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}{% endif %}\
             {% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %};{% endfor %}{{ flavour }}",
            "",
            "",
        )
        .expect("compiles");
        let mut call = ChatMessage::assistant("");
        call.tool_calls = Some(serde_json::json!([
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Oslo\"}"}}
        ]));
        let mut result = ChatMessage::new("tool", "cold");
        result.tool_call_id = Some("c1".into());
        let extras = RenderExtras {
            tools: Some(serde_json::json!([{"type": "function", "function": {"name": "w"}}])),
            kwargs: serde_json::json!({"flavour": "x", "messages": "ignored"})
                .as_object()
                .cloned(),
        };
        let out = t
            .render_with(&[ChatMessage::user("hi"), call, result], false, &extras)
            .expect("render");
        assert_eq!(out, "T:w;user:hi;assistant:[w Oslo];tool:cold(c1);x");
    }

    #[test]
    fn chatml_fallback() {
        let t = ChatTemplate::chatml("", "");
        assert!(t.is_fallback());
        let out = t
            .render(&[ChatMessage::system("S"), ChatMessage::user("U")], true)
            .expect("render");
        assert_eq!(
            out,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
