//! The values one stage hands to the next (see the module doc of [`super`]): the admitted
//! request, what the caches said, what the tries came to and the client's answer. Each
//! stage imports these and the stages before it, never a later stage, so a new stage
//! plugs in between two others by taking one of these values and giving one back.
//!
//! The request's accounting handle travels with them but owns behaviour of its own (it
//! settles exactly once, also when dropped): it lives in [`super::account`].

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use serde_json::Value;

use super::route::Route;
use super::send::Replica;
use crate::config::{ModelConfig, Resolved};
use crate::routing::{Attempt, Failure};
use crate::state::KeyEntry;
use crate::stream_guard::StreamGuard;
use crate::upstream::UpstreamBody;

/// A request that passed admission (stage 1).
pub(crate) struct Admitted {
    pub key: Arc<KeyEntry>,
    /// The config this request started with (a reload mid-request does not change it).
    pub resolved: Arc<Resolved>,
    pub route: Route,
    /// The client's request headers.
    pub headers: HeaderMap,
    /// The body as received, forwarded as is when nothing in it must change.
    pub bytes: Bytes,
    /// The body parsed once; `model` names the canonical public model from here on.
    pub body: Value,
    /// Whether `body` differs from `bytes` beyond its `model` (then it is re-serialized).
    pub rewritten: bool,
    /// The `model` the client sent (a public name or an alias).
    pub requested: String,
    /// Index of the model in `resolved.config.models` (read through [`Admitted::model`]).
    pub(super) model_index: usize,
    pub stream: bool,
    /// Characters of prompt text.
    pub prompt_chars: usize,
    /// Estimated prompt + output tokens (charged to token limits until settled).
    pub estimate: u64,
    /// Headers every answer carries from here on (request id, rate-limit state, cache).
    pub extra: HeaderMap,
    pub request_id: HeaderValue,
}

impl Admitted {
    /// The public model the request names.
    pub fn model(&self) -> &ModelConfig {
        &self.resolved.config.models[self.model_index]
    }
}

/// What the caches said (stage 2). A hit's body is ready to send (SSE for a streamed
/// request).
pub(crate) enum Lookup {
    /// A stored answer for exactly this request.
    Hit(Bytes),
    /// A stored answer for a similar request.
    Semantic(Bytes),
    /// No answer; where a fresh one is stored.
    Miss(Store),
}

/// Where a fresh answer goes.
#[derive(Default)]
pub(crate) struct Store {
    /// The exact cache's key (`None`: not cacheable).
    pub cache_key: Option<[u8; 32]>,
    /// The semantic cache's bucket and the request's vector.
    pub semantic: Option<([u8; 32], Vec<f32>)>,
}

impl Store {
    /// True when a fresh answer goes anywhere.
    pub fn is_some(&self) -> bool {
        self.cache_key.is_some() || self.semantic.is_some()
    }
}

/// Which try answered.
#[derive(Debug, Clone)]
pub(crate) struct Served {
    pub attempt: Attempt,
    /// Tries made, this one included.
    pub tries: u32,
    /// The replica (`host:port`) when an embedded router chose it.
    pub replica: Option<String>,
}

/// What the tries came to (stage 4).
pub(crate) enum Tried {
    /// A 2xx answer, read whole (the replica's lease is already released).
    Whole {
        status: u16,
        content_type: Option<HeaderValue>,
        bytes: Bytes,
        served: Served,
    },
    /// A 2xx streamed answer: its head, the body still to come, the replica's lease.
    Stream {
        resp: axum::http::Response<UpstreamBody>,
        lease: Option<Replica>,
        served: Served,
    },
    /// Nothing answered 2xx: the last failure (`None` when the deadline left no try).
    Failed(Option<Failure>),
}

/// The client's answer and what its accounting needs (stage 5).
pub(crate) enum Reply {
    /// A complete response; settle with this usage and status now.
    Whole {
        response: Response,
        usage: Option<(u64, u64)>,
        status: u16,
        cached: bool,
    },
    /// A stream still to be relayed; settled when it ends.
    Stream(Box<StreamReply>),
}

/// A streamed answer's head, body to come, replica lease and output guardrails.
pub(crate) struct StreamReply {
    pub resp: axum::http::Response<UpstreamBody>,
    pub lease: Option<Replica>,
    pub guard: Option<StreamGuard>,
    pub extra: HeaderMap,
    /// Where the answer is stored once the stream completed (nowhere when the request is
    /// not cacheable).
    pub store: Store,
    /// The largest answer the caches keep (the request's `cache.max_entry_bytes`).
    pub max_entry_bytes: usize,
}
