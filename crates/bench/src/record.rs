//! What one request measured, and how it failed.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Why a request did not complete. Each kind is counted separately in the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailureKind {
    /// The server refused the TCP connection (nothing listening).
    ConnectionRefused,
    /// Connecting failed otherwise (DNS, unreachable, reset during connect).
    Connect,
    /// No complete response within `--timeout`.
    Timeout,
    /// The server answered with a non-2xx status.
    HttpStatus(u16),
    /// The stream ended, or the connection broke, before the response was complete.
    StreamCut,
    /// The server sent an error object inside the stream.
    StreamError,
    /// The response was not the OpenAI shape (unparseable JSON, no choices).
    InvalidResponse,
    /// Any other transport failure.
    Transport,
}

impl FailureKind {
    /// Stable name used as the key in reports: `connection_refused`, `http_503`, ...
    pub fn key(&self) -> String {
        match self {
            FailureKind::ConnectionRefused => "connection_refused".into(),
            FailureKind::Connect => "connect".into(),
            FailureKind::Timeout => "timeout".into(),
            FailureKind::HttpStatus(code) => format!("http_{code}"),
            FailureKind::StreamCut => "stream_cut".into(),
            FailureKind::StreamError => "stream_error".into(),
            FailureKind::InvalidResponse => "invalid_response".into(),
            FailureKind::Transport => "transport".into(),
        }
    }
}

/// A failed request's kind and the first words of why.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// The kind counted in the report.
    pub kind: FailureKind,
    /// A short human-readable message (the server's error message when it sent one).
    pub message: String,
}

/// Measurements of one request. Times are from the run's start (`start`) or from the
/// request's own send (`ttft`, `e2e`, `token_times`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestRecord {
    /// When the request was sent, from the start of the run.
    pub start: Duration,
    /// Time to the first streamed chunk with content.
    pub ttft: Option<Duration>,
    /// Time to the end of the response.
    pub e2e: Duration,
    /// Arrival times of every streamed chunk with content, from `start`. Gaps between
    /// consecutive entries are the ITL samples.
    pub token_times: Vec<Duration>,
    /// `usage.prompt_tokens`, when the server reported it.
    pub prompt_tokens: Option<u32>,
    /// The prompt length the workload asked for.
    pub planned_prompt_tokens: u32,
    /// `usage.completion_tokens`, when the server reported it.
    pub completion_tokens: Option<u32>,
    /// `usage.prompt_tokens_details.cached_tokens`, when the server reported it.
    pub cached_tokens: Option<u32>,
    /// The replica that served it, from a response header (see
    /// [`crate::client::SERVED_BY_HEADERS`]).
    pub served_by: Option<String>,
    /// The reply text (kept only when a later turn needs it).
    pub text: String,
    /// Set when the request failed.
    pub failure: Option<Failure>,
}

impl RequestRecord {
    /// True when the request completed.
    pub fn ok(&self) -> bool {
        self.failure.is_none()
    }

    /// Output tokens: the server's `usage.completion_tokens`, else the number of chunks
    /// with content.
    pub fn output_tokens(&self) -> u32 {
        self.completion_tokens
            .unwrap_or(self.token_times.len() as u32)
    }

    /// Input tokens: the server's `usage.prompt_tokens`, else the planned length.
    pub fn input_tokens(&self) -> u32 {
        self.prompt_tokens.unwrap_or(self.planned_prompt_tokens)
    }

    /// TPOT = (e2e - ttft) / (output tokens - 1); `None` for fewer than two tokens.
    pub fn tpot(&self) -> Option<Duration> {
        let ttft = self.ttft?;
        let out = self.output_tokens();
        if out < 2 {
            return None;
        }
        Some(self.e2e.saturating_sub(ttft) / (out - 1))
    }

    /// Gaps between consecutive content chunks.
    pub fn itls(&self) -> impl Iterator<Item = Duration> + '_ {
        self.token_times
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]))
    }
}

/// The per-request line kept in a report (no per-token data).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestLine {
    /// Send time from the start of the run, seconds.
    pub start_s: f64,
    /// Time to first token, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// End-to-end latency, milliseconds.
    pub e2e_ms: f64,
    /// Input tokens (server-reported when available).
    pub input_tokens: u32,
    /// Output tokens (server-reported when available).
    pub output_tokens: u32,
    /// The failure kind's key, when it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl From<&RequestRecord> for RequestLine {
    fn from(r: &RequestRecord) -> Self {
        RequestLine {
            start_s: r.start.as_secs_f64(),
            ttft_ms: r.ttft.map(ms),
            e2e_ms: ms(r.e2e),
            input_tokens: r.input_tokens(),
            output_tokens: r.output_tokens(),
            error: r.failure.as_ref().map(|f| f.kind.key()),
        }
    }
}

/// Milliseconds as `f64`.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn tpot_and_itl_follow_the_definitions() {
        let r = RequestRecord {
            start: at(1000),
            ttft: Some(at(100)),
            e2e: at(400),
            token_times: vec![at(1100), at(1200), at(1250), at(1400)],
            completion_tokens: Some(4),
            ..Default::default()
        };
        assert_eq!(r.tpot(), Some(at(100)));
        let itl: Vec<_> = r.itls().collect();
        assert_eq!(itl, [at(100), at(50), at(150)]);
    }

    #[test]
    fn output_tokens_fall_back_to_chunks() {
        let r = RequestRecord {
            ttft: Some(at(1)),
            e2e: at(2),
            token_times: vec![at(1)],
            ..Default::default()
        };
        assert_eq!(r.output_tokens(), 1);
        assert_eq!(r.tpot(), None);
    }

    #[test]
    fn failure_keys_are_stable() {
        assert_eq!(FailureKind::HttpStatus(503).key(), "http_503");
        assert_eq!(FailureKind::ConnectionRefused.key(), "connection_refused");
        assert_eq!(FailureKind::StreamCut.key(), "stream_cut");
    }
}
