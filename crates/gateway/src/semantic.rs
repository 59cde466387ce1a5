//! The semantic cache: a request *similar* to one answered before is answered from the
//! cache, without inference.
//!
//! What makes two requests "the same question":
//! * the **scope** — tenant and public model — always matches exactly (an answer never
//!   crosses tenants or models);
//! * the **context** — every part of the request but the last user message (system
//!   prompt, earlier turns, sampling parameters, tools) — matches exactly, as a hash; so
//!   "and the second one?" in one conversation never finds another conversation's answer;
//! * the **last user message** is embedded, and its cosine similarity to a stored one must
//!   reach the threshold (default 0.9; a request header may raise it, never lower it).
//!
//! Requests are not looked up or stored ([`Skip`]) above `max_messages` messages, when
//! they call or offer tools, and when they sample (`temperature` absent or above 0) unless
//! configured. A streamed request is looked up like any other; its answer is stored only
//! once the stream completed (`proxy::stream`).
//!
//! The index ([`SemanticIndex`]) is in memory: entries grouped by (scope, context) and
//! scanned there (vectors are unit length, so cosine is a dot product), a TTL, and a
//! bound on entries with the oldest evicted first. It is pure: `now` is passed in.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// `cache.semantic` in `gateway.yaml`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SemanticConfig {
    #[serde(default)]
    pub enabled: bool,
    /// The public model (an ordinary `models` entry) that serves `/v1/embeddings`.
    #[serde(default)]
    pub embedding_model: String,
    /// Cosine similarity needed for a hit.
    #[serde(default = "default_threshold")]
    pub threshold: f32,
    /// Requests with more messages than this are not cached.
    #[serde(default = "default_max_messages")]
    pub max_messages: usize,
    #[serde(default = "default_ttl")]
    pub ttl_secs: u64,
    #[serde(default = "default_max_entries")]
    pub max_entries: usize,
    /// Also cache requests that sample (`temperature` absent or above 0).
    #[serde(default)]
    pub include_sampled: bool,
    /// Share entries with the other replicas through this Redis
    /// ([`crate::semantic_share`]); unset: this replica's index only.
    #[serde(default)]
    pub redis_url: Option<String>,
    /// The Redis stream that carries the shared entries.
    #[serde(default = "default_redis_stream")]
    pub redis_stream: String,
}

impl Default for SemanticConfig {
    fn default() -> Self {
        SemanticConfig {
            enabled: false,
            embedding_model: String::new(),
            threshold: default_threshold(),
            max_messages: default_max_messages(),
            ttl_secs: default_ttl(),
            max_entries: default_max_entries(),
            include_sampled: false,
            redis_url: None,
            redis_stream: default_redis_stream(),
        }
    }
}

fn default_redis_stream() -> String {
    "strata:semantic".into()
}
fn default_threshold() -> f32 {
    0.9
}
fn default_max_messages() -> usize {
    3
}
fn default_ttl() -> u64 {
    300
}
fn default_max_entries() -> usize {
    100_000
}

/// Request header: `off` (or `no-cache`) skips the semantic cache; a number raises the
/// similarity needed for this request (a lower number is ignored).
pub const SEMANTIC_HEADER: &str = "x-strata-semantic-cache";

/// What a request header asks of the semantic cache.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HeaderAsk {
    Default,
    Off,
    Threshold(f32),
}

impl HeaderAsk {
    pub fn parse(value: Option<&str>) -> HeaderAsk {
        match value.map(str::trim) {
            None | Some("") => HeaderAsk::Default,
            Some(v) if v.eq_ignore_ascii_case("off") || v.eq_ignore_ascii_case("no-cache") => {
                HeaderAsk::Off
            }
            Some(v) => match v.parse::<f32>() {
                Ok(t) if t.is_finite() => HeaderAsk::Threshold(t),
                _ => HeaderAsk::Default,
            },
        }
    }

    /// The threshold for this request: the configured one, raised (never lowered).
    pub fn threshold(self, configured: f32) -> f32 {
        match self {
            HeaderAsk::Threshold(t) => t.max(configured),
            _ => configured,
        }
    }
}

/// Why a request does not use the semantic cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    TooManyMessages,
    Tools,
    Sampled,
    NoUserMessage,
}

/// Where a request's answer lives: (scope, context) hashed, and the text to embed.
#[derive(Debug, Clone, PartialEq)]
pub struct SemanticKey {
    pub bucket: [u8; 32],
    pub text: String,
}

/// Fields that never change the answer (as for the exact cache).
const IGNORED: &[&str] = &["stream", "stream_options", "user", "model"];

/// The key of a chat request for `tenant` on public `model`, or why it is skipped.
pub fn request_key(
    tenant: &str,
    model: &str,
    body: &Value,
    config: &SemanticConfig,
) -> Result<SemanticKey, Skip> {
    let msgs = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or(Skip::NoUserMessage)?;
    if msgs.len() > config.max_messages {
        return Err(Skip::TooManyMessages);
    }
    let offers_tools = body
        .get("tools")
        .or_else(|| body.get("functions"))
        .is_some_and(|t| !t.is_null());
    let uses_tools = msgs.iter().any(|m| {
        m.get("role").and_then(Value::as_str) == Some("tool")
            || m.get("tool_calls").is_some_and(|t| !t.is_null())
    });
    if offers_tools || uses_tools {
        return Err(Skip::Tools);
    }
    let greedy = body
        .get("temperature")
        .and_then(Value::as_f64)
        .is_some_and(|t| t == 0.0);
    if !greedy && !config.include_sampled {
        return Err(Skip::Sampled);
    }
    let last = msgs.last().ok_or(Skip::NoUserMessage)?;
    if last.get("role").and_then(Value::as_str) != Some("user") {
        return Err(Skip::NoUserMessage);
    }
    let text = match last.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => return Err(Skip::NoUserMessage),
    };
    if text.trim().is_empty() {
        return Err(Skip::NoUserMessage);
    }
    // The context: the body without the last message and the ignored fields, with
    // object keys in sorted order (serde_json's map is sorted), hashed with the scope.
    let mut context = body.clone();
    if let Some(obj) = context.as_object_mut() {
        for f in IGNORED {
            obj.remove(*f);
        }
        if let Some(Value::Array(m)) = obj.get_mut("messages") {
            m.pop();
        }
    }
    let mut h = Sha256::new();
    for part in [tenant.as_bytes(), &[0], model.as_bytes(), &[0]] {
        h.update(part);
    }
    h.update(context.to_string().as_bytes());
    Ok(SemanticKey {
        bucket: h.finalize().into(),
        text,
    })
}

/// Scales a vector to unit length (`None` for a zero or non-finite vector).
pub fn normalized(mut v: Vec<f32>) -> Option<Vec<f32>> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if !(norm.is_finite() && norm > 0.0) {
        return None;
    }
    v.iter_mut().for_each(|x| *x /= norm);
    Some(v)
}

/// The dot product, in eight independent lanes so the compiler can keep them in one
/// vector register (a single running sum is a chain of dependent adds, several times
/// slower). Summing in another order changes the last bits only.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// One stored answer (its vector lives in the bucket's `vectors`, same position).
struct Entry {
    seq: u64,
    answer: Bytes,
    stored: Instant,
}

/// The entries of one (scope, context). Invariant: `vectors.len() == entries.len() * dim`,
/// entry `i`'s vector at `vectors[i * dim..][..dim]`; one contiguous array, so a lookup
/// streams through memory instead of following a pointer per entry.
struct Bucket {
    dim: usize,
    vectors: Vec<f32>,
    entries: Vec<Entry>,
}

impl Bucket {
    fn vector(&self, i: usize) -> &[f32] {
        &self.vectors[i * self.dim..(i + 1) * self.dim]
    }

    /// Removes entry `i` by moving the last one into its place.
    fn swap_remove(&mut self, i: usize) {
        let last = self.entries.len() - 1;
        if i != last {
            let (d, v) = (self.dim, &mut self.vectors);
            v.copy_within(last * d..(last + 1) * d, i * d);
        }
        self.vectors.truncate(last * self.dim);
        self.entries.swap_remove(i);
    }

    /// Drops entries stored `ttl` or longer before `now`; how many went.
    fn expire(&mut self, ttl: Duration, now: Instant) -> usize {
        let before = self.entries.len();
        let mut i = 0;
        while i < self.entries.len() {
            if now.saturating_duration_since(self.entries[i].stored) >= ttl {
                self.swap_remove(i);
            } else {
                i += 1;
            }
        }
        before - self.entries.len()
    }
}

struct Inner {
    buckets: HashMap<[u8; 32], Bucket>,
    /// Insertion order over all buckets, for eviction: (bucket, entry seq).
    order: VecDeque<([u8; 32], u64)>,
    len: usize,
    next_seq: u64,
}

/// The in-memory index (see the module doc).
pub struct SemanticIndex {
    ttl: Duration,
    max_entries: usize,
    inner: Mutex<Inner>,
}

impl SemanticIndex {
    pub fn new(max_entries: usize, ttl: Duration) -> SemanticIndex {
        SemanticIndex {
            ttl,
            max_entries: max_entries.max(1),
            inner: Mutex::new(Inner {
                buckets: HashMap::new(),
                order: VecDeque::new(),
                len: 0,
                next_seq: 0,
            }),
        }
    }

    /// The best stored answer in `bucket` at least `threshold` similar to `vector` (unit
    /// length), with its similarity. Expired entries are dropped on the way.
    pub fn get(
        &self,
        bucket: &[u8; 32],
        vector: &[f32],
        threshold: f32,
        now: Instant,
    ) -> Option<(Bytes, f32)> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let b = inner.buckets.get_mut(bucket)?;
        let expired = b.expire(self.ttl, now);
        // A vector of another length (another embedding model) never matches.
        let best = (b.dim == vector.len())
            .then(|| {
                (0..b.entries.len())
                    .map(|i| (dot(b.vector(i), vector), i))
                    .filter(|(s, _)| *s >= threshold)
                    .max_by(|x, y| x.0.total_cmp(&y.0))
                    .map(|(s, i)| (b.entries[i].answer.clone(), s))
            })
            .flatten();
        if b.entries.is_empty() {
            inner.buckets.remove(bucket);
        }
        inner.len -= expired;
        best
    }

    /// Stores an answer (stored at `now`); the oldest entries go once the bound is
    /// reached. A vector whose length differs from the bucket's is not stored, nor an
    /// answer that calls tools (never served from this cache, even if its request slipped
    /// past [`request_key`]).
    pub fn put(&self, bucket: [u8; 32], vector: Vec<f32>, answer: Bytes, now: Instant) {
        if vector.is_empty() || crate::cache::is_tool_call_answer(&answer) {
            return;
        }
        let mut inner = self.inner.lock();
        let seq = inner.next_seq;
        let b = inner.buckets.entry(bucket).or_insert_with(|| Bucket {
            dim: vector.len(),
            vectors: Vec::new(),
            entries: Vec::new(),
        });
        if b.dim != vector.len() {
            return;
        }
        b.vectors.extend_from_slice(&vector);
        b.entries.push(Entry {
            seq,
            answer,
            stored: now,
        });
        inner.next_seq += 1;
        inner.order.push_back((bucket, seq));
        inner.len += 1;
        while inner.len > self.max_entries {
            let Some((k, s)) = inner.order.pop_front() else {
                break;
            };
            let Some(b) = inner.buckets.get_mut(&k) else {
                continue; // already gone (expired)
            };
            let Some(pos) = b.entries.iter().position(|e| e.seq == s) else {
                continue;
            };
            b.swap_remove(pos);
            if b.entries.is_empty() {
                inner.buckets.remove(&k);
            }
            inner.len -= 1;
        }
        // The order queue also holds entries that expired through `get`; keep it from
        // growing past twice the bound.
        if inner.order.len() > 2 * self.max_entries {
            let live: std::collections::HashSet<([u8; 32], u64)> = inner
                .buckets
                .iter()
                .flat_map(|(k, b)| b.entries.iter().map(move |e| (*k, e.seq)))
                .collect();
            inner.order.retain(|k| live.contains(k));
        }
    }

    pub fn len(&self) -> usize {
        self.inner.lock().len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The first vector of an OpenAI `/v1/embeddings` answer.
pub fn embedding_from_json(bytes: &[u8]) -> Option<Vec<f32>> {
    #[derive(Deserialize)]
    struct Answer {
        data: Vec<Item>,
    }
    #[derive(Deserialize)]
    struct Item {
        embedding: Vec<f32>,
    }
    let a: Answer = serde_json::from_slice(bytes).ok()?;
    a.data.into_iter().next().map(|i| i.embedding)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Real all-MiniLM-L6-v2 vectors of the fixture's sentences, by text.
    fn minilm(text: &str) -> Vec<f32> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/minilm/reference.json"
        );
        let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let item = v["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["text"] == text)
            .unwrap_or_else(|| panic!("no fixture for {text}"));
        let raw: Vec<f32> = serde_json::from_value(item["embedding"].clone()).unwrap();
        normalized(raw).unwrap()
    }

    fn config() -> SemanticConfig {
        SemanticConfig {
            enabled: true,
            embedding_model: "minilm".into(),
            ..Default::default()
        }
    }

    fn chat(msgs: Value) -> Value {
        json!({"model": "m", "temperature": 0, "messages": msgs})
    }

    fn user(text: &str) -> Value {
        chat(json!([{"role": "user", "content": text}]))
    }

    const FRANCE: &str = "What is the capital city of France?";
    const FRANCE_AGAIN: &str = "Tell me the capital of France.";
    const GERMANY: &str = "What is the capital of Germany?";

    #[test]
    fn paraphrases_hit_and_unrelated_questions_miss() {
        let c = config();
        let idx = SemanticIndex::new(10, Duration::from_secs(60));
        let now = Instant::now();
        let k1 = request_key("t", "m", &user(FRANCE), &c).unwrap();
        idx.put(k1.bucket, minilm(FRANCE), Bytes::from_static(b"paris"), now);
        let k2 = request_key("t", "m", &user(FRANCE_AGAIN), &c).unwrap();
        assert_eq!(k1.bucket, k2.bucket, "same context, different last message");
        let (hit, sim) = idx
            .get(&k2.bucket, &minilm(FRANCE_AGAIN), c.threshold, now)
            .unwrap();
        assert_eq!(hit, "paris");
        assert!(sim > 0.9 && sim < 0.95, "{sim}");
        for other in [
            GERMANY,
            "How long should I knead bread dough?",
            "Quarterly revenue rose by 8 percent.",
        ] {
            assert!(idx
                .get(&k2.bucket, &minilm(other), c.threshold, now)
                .is_none());
        }
        // A raised threshold turns the paraphrase into a miss; a lowered one is ignored.
        let strict = HeaderAsk::parse(Some("0.95")).threshold(c.threshold);
        assert!(idx
            .get(&k2.bucket, &minilm(FRANCE_AGAIN), strict, now)
            .is_none());
        let lax = HeaderAsk::parse(Some("0.1")).threshold(c.threshold);
        assert_eq!(lax, 0.9);
        assert!(idx.get(&k2.bucket, &minilm(GERMANY), lax, now).is_none());
    }

    #[test]
    fn scope_and_context_are_exact() {
        let c = config();
        let base = request_key("t", "m", &user(FRANCE), &c).unwrap();
        assert_ne!(
            base.bucket,
            request_key("u", "m", &user(FRANCE), &c).unwrap().bucket
        );
        assert_ne!(
            base.bucket,
            request_key("t", "m2", &user(FRANCE), &c).unwrap().bucket
        );
        let mut other_params = user(FRANCE);
        other_params["max_tokens"] = json!(5);
        assert_ne!(
            base.bucket,
            request_key("t", "m", &other_params, &c).unwrap().bucket
        );
        // Fields that do not change the answer do not change the key.
        let mut same = user(FRANCE);
        same["user"] = json!("someone");
        same["model"] = json!("alias");
        assert_eq!(
            base.bucket,
            request_key("t", "m", &same, &c).unwrap().bucket
        );
        // Follow-ups: the same words after different conversations are different keys.
        let follow = |first: &str| {
            chat(json!([
                {"role": "user", "content": first},
                {"role": "assistant", "content": "Here are two options."},
                {"role": "user", "content": "and the second one?"}
            ]))
        };
        let a = request_key("t", "m", &follow(FRANCE), &c).unwrap();
        let b = request_key("t", "m", &follow("A cat sits on the mat."), &c).unwrap();
        assert_ne!(a.bucket, b.bucket);
        assert_eq!(a.text, "and the second one?");
        let mut sys = user(FRANCE);
        sys["messages"] = json!([{"role": "system", "content": "Answer in French."},
            {"role": "user", "content": FRANCE}]);
        assert_ne!(base.bucket, request_key("t", "m", &sys, &c).unwrap().bucket);
    }

    #[test]
    fn skipped_requests() {
        let c = config();
        let many = chat(json!([
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
            {"role": "user", "content": "e"}
        ]));
        let mut tools = user(FRANCE);
        tools["tools"] = json!([{"type": "function", "function": {"name": "f"}}]);
        let tool_reply = chat(json!([
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": "42"},
            {"role": "user", "content": "thanks"}
        ]));
        let mut sampled = user(FRANCE);
        sampled["temperature"] = json!(0.7);
        let mut unset = user(FRANCE);
        unset.as_object_mut().unwrap().remove("temperature");
        let last_assistant = chat(json!([{"role": "assistant", "content": "hi"}]));
        let cases = [
            (many, Skip::TooManyMessages),
            (tools, Skip::Tools),
            (tool_reply, Skip::Tools),
            (sampled.clone(), Skip::Sampled),
            (unset, Skip::Sampled),
            (last_assistant, Skip::NoUserMessage),
            (
                json!({"prompt": "x", "temperature": 0}),
                Skip::NoUserMessage,
            ),
        ];
        for (body, want) in cases {
            assert_eq!(request_key("t", "m", &body, &c), Err(want), "{body}");
        }
        let with_sampling = SemanticConfig {
            include_sampled: true,
            ..config()
        };
        assert!(request_key("t", "m", &sampled, &with_sampling).is_ok());
        // A streamed request has the same key as the same request unstreamed.
        let mut streamed = user(FRANCE);
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        assert_eq!(
            request_key("t", "m", &streamed, &c),
            request_key("t", "m", &user(FRANCE), &c)
        );
    }

    #[test]
    fn ttl_and_size_bound() {
        let idx = SemanticIndex::new(2, Duration::from_secs(10));
        let t0 = Instant::now();
        let v = minilm(FRANCE);
        idx.put([1; 32], v.clone(), Bytes::from_static(b"a"), t0);
        idx.put([2; 32], v.clone(), Bytes::from_static(b"b"), t0);
        idx.put([3; 32], v.clone(), Bytes::from_static(b"c"), t0);
        assert_eq!(idx.len(), 2);
        assert!(idx.get(&[1; 32], &v, 0.9, t0).is_none(), "oldest evicted");
        assert!(idx.get(&[2; 32], &v, 0.9, t0).is_some());
        assert!(idx
            .get(&[3; 32], &v, 0.9, t0 + Duration::from_secs(11))
            .is_none());
        assert_eq!(idx.len(), 1, "the expired entry was dropped");
    }

    #[test]
    fn tool_call_answers_are_not_stored() {
        let idx = SemanticIndex::new(4, Duration::from_secs(10));
        let t0 = Instant::now();
        let v = minilm(FRANCE);
        let call = br#"{"choices": [{"finish_reason": "tool_calls", "message": {"tool_calls": [{"id": "1"}]}}]}"#;
        idx.put([1; 32], v.clone(), Bytes::from_static(call), t0);
        assert!(idx.is_empty());
        assert!(idx.get(&[1; 32], &v, 0.9, t0).is_none());
    }

    #[test]
    fn removal_keeps_vectors_with_their_answers() {
        // Three entries in one bucket; the oldest is evicted from the middle of the
        // contiguous array, and each remaining answer still comes with its own vector.
        let idx = SemanticIndex::new(2, Duration::from_secs(60));
        let t0 = Instant::now();
        let unit = |i: usize| {
            let mut v = vec![0.0; 10];
            v[i] = 1.0;
            v
        };
        idx.put([1; 32], unit(0), Bytes::from_static(b"zero"), t0);
        idx.put([1; 32], unit(1), Bytes::from_static(b"one"), t0);
        idx.put([1; 32], unit(2), Bytes::from_static(b"two"), t0);
        assert_eq!(idx.len(), 2);
        assert!(idx.get(&[1; 32], &unit(0), 0.9, t0).is_none());
        assert_eq!(idx.get(&[1; 32], &unit(1), 0.9, t0).unwrap().0, "one");
        assert_eq!(idx.get(&[1; 32], &unit(2), 0.9, t0).unwrap().0, "two");
        // Another length (another embedding model) is neither stored nor matched.
        idx.put([1; 32], vec![1.0; 3], Bytes::from_static(b"short"), t0);
        assert_eq!(idx.len(), 2);
        assert!(idx.get(&[1; 32], &[1.0, 0.0, 0.0], 0.5, t0).is_none());
        // The lane-wise dot product equals the plain one (up to rounding).
        let a: Vec<f32> = (0..21).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..21).map(|i| (i as f32 * 0.11).cos()).collect();
        let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - plain).abs() < 1e-5);
    }

    #[test]
    fn header_and_vector_parsing() {
        assert_eq!(HeaderAsk::parse(None), HeaderAsk::Default);
        assert_eq!(HeaderAsk::parse(Some("OFF")), HeaderAsk::Off);
        assert_eq!(HeaderAsk::parse(Some("0.97")), HeaderAsk::Threshold(0.97));
        assert_eq!(HeaderAsk::parse(Some("NaN")), HeaderAsk::Default);
        assert_eq!(HeaderAsk::parse(Some("junk")), HeaderAsk::Default);
        assert!(normalized(vec![0.0, 0.0]).is_none());
        assert_eq!(normalized(vec![3.0, 4.0]).unwrap(), vec![0.6, 0.8]);
        let answer =
            br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5,1.5]}]}"#;
        assert_eq!(embedding_from_json(answer), Some(vec![0.5, 1.5]));
        assert_eq!(embedding_from_json(b"{}"), None);
        assert_eq!(embedding_from_json(b"not json"), None);
    }
}
