//! W3C Trace Context (`traceparent`, version 00) and the one hook through which the gateway,
//! router and engine take part in a distributed trace: the header crosses every HTTP hop,
//! each process naming its own span as the next hop's parent.
//!
//! The library crates never talk to a trace exporter. They make ordinary `tracing` spans
//! with target [`SPAN_TARGET`] and call the functions here:
//!
//! * [`accept`] when a request arrives: parses its `traceparent` (a malformed one is treated
//!   as absent, never refused) and makes it the parent of the request's span;
//! * [`outgoing`] before a request leaves: the `traceparent` to send, naming the current
//!   span as the parent;
//! * [`record_child`] for a span whose times were measured elsewhere (the engine thread
//!   stamps each sequence's queue, prefill and decode; the handler emits them when the
//!   request ends, so no span guard ever crosses threads).
//!
//! The binary installs an [`Exporter`] (OTLP over HTTP) only when an endpoint is
//! configured. Without one these calls cost a few comparisons, and a process passes the
//! `traceparent` it received on unchanged, so a trace stays whole across a hop that does
//! not export.

use std::fmt;
use std::sync::OnceLock;
use std::time::Instant;

/// The W3C Trace Context request header.
pub const TRACEPARENT: &str = "traceparent";

/// The `tracing` target of every span meant for export. The binary's exporter layer listens
/// to this target only, and its log output leaves it out unless asked for.
pub const SPAN_TARGET: &str = "strata_trace";

/// Length of a version-00 `traceparent`: `vv-<32 hex>-<16 hex>-ff`.
const LEN_V00: usize = 55;

/// One parsed `traceparent`: the trace, the caller's span (our parent) and the flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    /// The span of the caller; never all zeros.
    pub parent_id: [u8; 8],
    /// Bit 0: sampled. Other bits are carried as received.
    pub flags: u8,
}

/// Why a `traceparent` value was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TraceParentError {
    #[error("traceparent has the wrong length")]
    Length,
    #[error("traceparent version is not lowercase hex, or is the forbidden `ff`")]
    Version,
    #[error("traceparent fields are not separated by `-`")]
    Separator,
    #[error("traceparent {0} is not lowercase hex of the right length")]
    Hex(&'static str),
    #[error("traceparent {0} is all zeros")]
    Zero(&'static str),
}

impl TraceParent {
    /// Bit 0 of the flags.
    pub const SAMPLED: u8 = 0x01;

    /// Parses a header value. Version 00 must be exactly 55 characters; a later version
    /// is read for its version-00 fields when what follows them starts with `-` (the
    /// specification's rule for versions this code does not know). Hex must be lowercase.
    pub fn parse(value: &[u8]) -> Result<Self, TraceParentError> {
        let v = value.trim_ascii();
        if v.len() < LEN_V00 {
            return Err(TraceParentError::Length);
        }
        let version = hex_byte(&v[0..2]).ok_or(TraceParentError::Version)?;
        if version == 0xff {
            return Err(TraceParentError::Version);
        }
        if version == 0 && v.len() != LEN_V00 {
            return Err(TraceParentError::Length);
        }
        if v.len() > LEN_V00 && v[LEN_V00] != b'-' {
            return Err(TraceParentError::Length);
        }
        if v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
            return Err(TraceParentError::Separator);
        }
        let mut trace_id = [0u8; 16];
        decode_into(&v[3..35], &mut trace_id).ok_or(TraceParentError::Hex("trace-id"))?;
        let mut parent_id = [0u8; 8];
        decode_into(&v[36..52], &mut parent_id).ok_or(TraceParentError::Hex("parent-id"))?;
        let flags = hex_byte(&v[53..55]).ok_or(TraceParentError::Hex("trace-flags"))?;
        if trace_id == [0; 16] {
            return Err(TraceParentError::Zero("trace-id"));
        }
        if parent_id == [0; 8] {
            return Err(TraceParentError::Zero("parent-id"));
        }
        Ok(Self {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// A header value as received: `None` when absent or malformed (a bad `traceparent`
    /// starts a new trace; it is never a reason to refuse a request).
    pub fn from_header(value: Option<&[u8]>) -> Option<Self> {
        value.and_then(|v| Self::parse(v).ok())
    }

    /// A new trace's first span. Zero ids are invalid on the wire, so a zero draw is
    /// replaced by one.
    pub fn root(trace_id: u128, span_id: u64, sampled: bool) -> Self {
        Self {
            trace_id: trace_id.max(1).to_be_bytes(),
            parent_id: span_id.max(1).to_be_bytes(),
            flags: if sampled { Self::SAMPLED } else { 0 },
        }
    }

    /// The value to send for a child span `span_id` of this trace (same trace and flags).
    pub fn child(&self, span_id: u64) -> Self {
        Self {
            parent_id: span_id.max(1).to_be_bytes(),
            ..*self
        }
    }

    pub fn sampled(&self) -> bool {
        self.flags & Self::SAMPLED != 0
    }

    /// Lowercase hex of the trace id, as trace back ends print it.
    pub fn trace_id_hex(&self) -> String {
        hex::encode(self.trace_id)
    }
}

/// The header value, always version 00.
impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex::encode(self.trace_id),
            hex::encode(self.parent_id),
            self.flags
        )
    }
}

fn hex_nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn hex_byte(two: &[u8]) -> Option<u8> {
    match two {
        [h, l] => Some(hex_nibble(*h)? << 4 | hex_nibble(*l)?),
        _ => None,
    }
}

fn decode_into(src: &[u8], out: &mut [u8]) -> Option<()> {
    if src.len() != out.len() * 2 {
        return None;
    }
    for (o, pair) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = hex_byte(pair)?;
    }
    Some(())
}

/// A span measured elsewhere, recorded after the fact as a child of a live span.
#[derive(Debug, Clone, Copy)]
pub struct ChildSpan<'a> {
    pub name: &'static str,
    pub start: Instant,
    pub end: Instant,
    pub attributes: &'a [(&'static str, i64)],
}

/// What the binary installs to export spans (see the module doc).
pub trait Exporter: Send + Sync + 'static {
    /// Makes the remote `parent` the parent of `span`; called before `span` has children.
    fn set_parent(&self, span: &tracing::Span, parent: &TraceParent);
    /// `span`'s own trace context, when it is being recorded.
    fn context_of(&self, span: &tracing::Span) -> Option<TraceParent>;
    /// Records `child` as a finished child of `parent`.
    fn record_child(&self, parent: &tracing::Span, child: &ChildSpan<'_>);
}

static EXPORTER: OnceLock<Box<dyn Exporter>> = OnceLock::new();

/// Installs the process's exporter; `false` if one was installed already (it stays).
pub fn install(exporter: Box<dyn Exporter>) -> bool {
    EXPORTER.set(exporter).is_ok()
}

/// Whether spans are exported from this process.
pub fn exporting() -> bool {
    EXPORTER.get().is_some()
}

/// Reads an incoming request's `traceparent` header value and, when exporting, makes it
/// the parent of `span` (the request's span, before it has children). Returns it for
/// [`outgoing`].
pub fn accept(span: &tracing::Span, header: Option<&[u8]>) -> Option<TraceParent> {
    let parent = TraceParent::from_header(header);
    if let (Some(e), Some(p)) = (EXPORTER.get(), &parent) {
        e.set_parent(span, p);
    }
    parent
}

/// The `traceparent` to send downstream from inside `span`: `span` as the parent when it
/// is exported, else what this process received (`incoming`), unchanged.
pub fn outgoing(span: &tracing::Span, incoming: Option<&TraceParent>) -> Option<TraceParent> {
    EXPORTER
        .get()
        .and_then(|e| e.context_of(span))
        .or_else(|| incoming.copied())
}

/// Records a span measured elsewhere as a child of `parent` (nothing when not exporting).
pub fn record_child(parent: &tracing::Span, child: ChildSpan<'_>) {
    if let Some(e) = EXPORTER.get() {
        e.record_child(parent, &child);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_formats_the_specification_example() {
        let tp = TraceParent::parse(GOOD.as_bytes()).unwrap();
        assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex::encode(tp.parent_id), "00f067aa0ba902b7");
        assert!(tp.sampled());
        assert_eq!(tp.to_string(), GOOD);
        let unsampled = TraceParent::parse(GOOD.replace("-01", "-00").as_bytes()).unwrap();
        assert!(!unsampled.sampled());
        assert_eq!(unsampled.to_string(), GOOD.replace("-01", "-00"));
        // Surrounding blanks (left by some clients) are not part of the value.
        assert_eq!(TraceParent::parse(format!(" {GOOD}\t").as_bytes()), Ok(tp));
    }

    #[test]
    fn later_versions_are_read_for_their_version_00_fields() {
        let v = format!("cc{}-what-comes-next", &GOOD[2..]);
        let tp = TraceParent::parse(v.as_bytes()).unwrap();
        assert_eq!(tp.to_string(), GOOD, "forwarded as version 00");
        let exact = format!("01{}", &GOOD[2..]);
        assert!(TraceParent::parse(exact.as_bytes()).is_ok());
        let glued = format!("01{}x", &GOOD[2..]);
        assert_eq!(
            TraceParent::parse(glued.as_bytes()),
            Err(TraceParentError::Length)
        );
    }

    #[test]
    fn malformed_values_are_rejected_with_the_reason() {
        use TraceParentError::*;
        let zero_trace = "00-00000000000000000000000000000000-00f067aa0ba902b7-01";
        let zero_parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01";
        let cases: Vec<(String, TraceParentError)> = vec![
            (String::new(), Length),
            ("garbage".into(), Length),
            (GOOD[..54].into(), Length),
            (format!("{GOOD}-extra"), Length), // version 00 has no trailing fields
            (format!("ff{}", &GOOD[2..]), Version),
            (format!("0g{}", &GOOD[2..]), Version),
            (GOOD.to_uppercase(), Hex("trace-id")),
            (GOOD.replace("-00f0", "_00f0"), Separator),
            (GOOD.replace("4bf9", "4BF9"), Hex("trace-id")),
            (GOOD.replace("4bf9", "4bfz"), Hex("trace-id")),
            (GOOD.replace("00f067", "00F067"), Hex("parent-id")),
            (GOOD.replace("-01", "-0x"), Hex("trace-flags")),
            (zero_trace.into(), Zero("trace-id")),
            (zero_parent.into(), Zero("parent-id")),
        ];
        for (value, want) in cases {
            assert_eq!(TraceParent::parse(value.as_bytes()), Err(want), "{value:?}");
            assert_eq!(TraceParent::from_header(Some(value.as_bytes())), None);
        }
        // Not UTF-8 at all.
        let mut bytes = GOOD.as_bytes().to_vec();
        bytes[10] = 0xff;
        assert!(TraceParent::parse(&bytes).is_err());
        assert_eq!(TraceParent::from_header(None), None);
    }

    #[test]
    fn children_keep_the_trace_and_flags_and_ids_are_never_zero() {
        let root = TraceParent::root(0x1234, 0xabcd, true);
        assert_eq!(
            root.to_string(),
            "00-00000000000000000000000000001234-000000000000abcd-01"
        );
        let child = root.child(0x99);
        assert_eq!(child.trace_id, root.trace_id);
        assert_eq!(child.flags, root.flags);
        assert_eq!(child.parent_id, 0x99u64.to_be_bytes());
        // A zero draw would make an invalid header; what is sent always parses back.
        let zeros = TraceParent::root(0, 0, false);
        assert_eq!(TraceParent::parse(zeros.to_string().as_bytes()), Ok(zeros));
        assert_eq!(
            TraceParent::parse(root.child(0).to_string().as_bytes()),
            Ok(root.child(0))
        );
    }

    #[test]
    fn without_an_exporter_the_received_header_passes_through() {
        // This test binary never installs an exporter.
        let span = tracing::info_span!(target: "strata_trace", "test.request");
        assert!(!exporting());
        let incoming = accept(&span, Some(GOOD.as_bytes()));
        assert_eq!(
            outgoing(&span, incoming.as_ref()).map(|t| t.to_string()),
            Some(GOOD.to_string())
        );
        assert_eq!(accept(&span, Some(b"00-bad")), None);
        assert_eq!(outgoing(&span, None), None);
        // Recording a child is a no-op, not a panic.
        let now = Instant::now();
        record_child(
            &span,
            ChildSpan {
                name: "queue",
                start: now,
                end: now,
                attributes: &[],
            },
        );
    }
}
