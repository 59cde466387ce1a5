//! Building and reading the ext_proc messages (PROTOCOLS §5): header values, header
//! mutations, dynamic metadata, streamed body chunks and immediate responses.

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, common_response::ResponseStatus, processing_response, BodyMutation,
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use strata_api::ApiError;

/// Envoy's largest streamed body message is 64 KiB of frame; the reference picker keeps
/// each chunk below that with room for the envelope.
pub const MAX_CHUNK: usize = 62_000;

/// Dynamic-metadata namespace Envoy's load balancing reads.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The answer: header and `envoy.lb` metadata key, `ip:port[,ip:port...]`.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Filter-metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Subset-hint key: the endpoints the pick must come from.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// `envoy.lb` key a data plane may fill with the endpoint that served.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";

/// The value of a header as Envoy sent it: `raw_value` when set (what current Envoy
/// sends), else `value`.
pub fn header_bytes(h: &HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

/// The headers of a message as lower-cased names and byte values.
pub fn headers_of(map: Option<&HeaderMap>) -> Vec<(String, Vec<u8>)> {
    map.map(|m| {
        m.headers
            .iter()
            .map(|h| (h.key.to_ascii_lowercase(), header_bytes(h).to_vec()))
            .collect()
    })
    .unwrap_or_default()
}

/// One header to set, replacing any value it had.
pub fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// `{namespace: {key: value}}` as a `google.protobuf.Struct`.
pub fn dynamic_metadata(namespace: &str, key: &str, value: &str) -> Struct {
    let inner = Struct {
        fields: [(key.to_string(), string_value(value))]
            .into_iter()
            .collect(),
    };
    Struct {
        fields: [(
            namespace.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into_iter()
        .collect(),
    }
}

/// The strings a metadata value holds: a list of strings, or one comma-joined string.
fn strings_of(v: &Value) -> Vec<String> {
    let split = |s: &str| -> Vec<String> {
        s.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(str::to_string)
            .collect()
    };
    match &v.kind {
        Some(Kind::StringValue(s)) => split(s),
        Some(Kind::ListValue(ListValue { values })) => values
            .iter()
            .filter_map(|x| match &x.kind {
                Some(Kind::StringValue(s)) => Some(split(s)),
                _ => None,
            })
            .flatten()
            .collect(),
        _ => Vec::new(),
    }
}

/// A string list at `namespace` / `key` of filter metadata, when the key is present.
pub fn metadata_strings(md: Option<&Metadata>, namespace: &str, key: &str) -> Option<Vec<String>> {
    let v = md?.filter_metadata.get(namespace)?.fields.get(key)?;
    Some(strings_of(v))
}

/// A string attribute Envoy sent (`attributes[filter][name]`), e.g. `upstream.address`.
pub fn attribute_string(
    attrs: &std::collections::HashMap<String, Struct>,
    name: &str,
) -> Option<String> {
    attrs
        .values()
        .find_map(|s| match s.fields.get(name)?.kind.as_ref()? {
            Kind::StringValue(v) => Some(v.clone()),
            _ => None,
        })
}

fn common(
    mutation: Option<HeaderMutation>,
    body: Option<BodyMutation>,
    clear: bool,
) -> CommonResponse {
    CommonResponse {
        status: ResponseStatus::Continue as i32,
        header_mutation: mutation,
        body_mutation: body,
        trailers: None,
        clear_route_cache: clear,
    }
}

/// The answer to request headers: set `headers`, drop `remove`, re-route.
pub fn request_headers(
    set: Vec<HeaderValueOption>,
    remove: Vec<String>,
    metadata: Option<Struct>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(common(
                    Some(HeaderMutation {
                        set_headers: set,
                        remove_headers: remove,
                    }),
                    None,
                    true,
                )),
            },
        )),
        dynamic_metadata: metadata,
        ..Default::default()
    }
}

/// Continue on response headers, unchanged.
pub fn response_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseHeaders(
            HeadersResponse {
                response: Some(common(None, None, false)),
            },
        )),
        ..Default::default()
    }
}

fn streamed(body: &[u8], end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(common(
            None,
            Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body: body.to_vec(),
                        end_of_stream,
                    },
                )),
            }),
            false,
        )),
    }
}

/// The whole request body streamed back in chunks of at most [`MAX_CHUNK`] bytes; the last
/// carries `end_of_stream` (an empty body is one empty chunk).
pub fn request_body_chunks(body: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
    let wrap = |b: BodyResponse| ProcessingResponse {
        response: Some(processing_response::Response::RequestBody(b)),
        ..Default::default()
    };
    if body.is_empty() {
        return vec![wrap(streamed(&[], end_of_stream))];
    }
    let n = body.len().div_ceil(MAX_CHUNK);
    body.chunks(MAX_CHUNK)
        .enumerate()
        .map(|(i, c)| wrap(streamed(c, end_of_stream && i + 1 == n)))
        .collect()
}

/// One response-body chunk passed straight back.
pub fn response_body_chunk(body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseBody(BodyResponse {
            response: Some(common(
                None,
                Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::StreamedResponse(
                        StreamedBodyResponse {
                            body,
                            end_of_stream,
                        },
                    )),
                }),
                false,
            )),
        })),
        ..Default::default()
    }
}

/// Trailers pass unchanged.
pub fn request_trailers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestTrailers(
            TrailersResponse::default(),
        )),
        ..Default::default()
    }
}

/// Trailers pass unchanged.
pub fn response_trailers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseTrailers(
            TrailersResponse::default(),
        )),
        ..Default::default()
    }
}

/// An OpenAI-shaped error sent by Envoy in place of the upstream's answer.
pub fn immediate(err: &ApiError, request_id: &str) -> ProcessingResponse {
    let mut set = vec![set_header("content-type", "application/json")];
    if err.status == 429 || err.status == 503 {
        set.push(set_header("retry-after", "1"));
    }
    if !request_id.is_empty() {
        set.push(set_header("x-request-id", request_id));
    }
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(err.status),
                }),
                headers: Some(HeaderMutation {
                    set_headers: set,
                    remove_headers: Vec::new(),
                }),
                body: err.to_json_string().into_bytes(),
                grpc_status: None,
                details: err.message.clone(),
            },
        )),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk_lens(v: &[ProcessingResponse]) -> Vec<(usize, bool)> {
        v.iter()
            .map(|r| match &r.response {
                Some(processing_response::Response::RequestBody(b)) => {
                    match b
                        .response
                        .as_ref()
                        .and_then(|c| c.body_mutation.as_ref())
                        .and_then(|m| m.mutation.as_ref())
                    {
                        Some(body_mutation::Mutation::StreamedResponse(s)) => {
                            (s.body.len(), s.end_of_stream)
                        }
                        other => panic!("not streamed: {other:?}"),
                    }
                }
                other => panic!("not a body response: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn chunks_are_bounded_and_only_the_last_ends_the_stream() {
        let body = vec![7u8; 2 * MAX_CHUNK + 5];
        assert_eq!(
            chunk_lens(&request_body_chunks(&body, true)),
            vec![(MAX_CHUNK, false), (MAX_CHUNK, false), (5, true)]
        );
        assert_eq!(
            chunk_lens(&request_body_chunks(&body[..MAX_CHUNK], true)),
            vec![(MAX_CHUNK, true)]
        );
        assert_eq!(chunk_lens(&request_body_chunks(&[], true)), vec![(0, true)]);
        // Trailers follow: no chunk ends the stream.
        assert!(chunk_lens(&request_body_chunks(&body, false))
            .iter()
            .all(|(_, eos)| !eos));
    }

    #[test]
    fn metadata_lists_and_comma_strings_both_read() {
        let md = |v: Value| Metadata {
            filter_metadata: [(
                SUBSET_NAMESPACE.to_string(),
                Struct {
                    fields: [(SUBSET_KEY.to_string(), v)].into_iter().collect(),
                },
            )]
            .into_iter()
            .collect(),
            ..Default::default()
        };
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string_value("10.0.0.1:8000"), string_value("10.0.0.2:8000")],
            })),
        };
        let want = vec!["10.0.0.1:8000".to_string(), "10.0.0.2:8000".to_string()];
        assert_eq!(
            metadata_strings(Some(&md(list)), SUBSET_NAMESPACE, SUBSET_KEY),
            Some(want.clone())
        );
        assert_eq!(
            metadata_strings(
                Some(&md(string_value("10.0.0.1:8000, 10.0.0.2:8000"))),
                SUBSET_NAMESPACE,
                SUBSET_KEY
            ),
            Some(want)
        );
        assert_eq!(metadata_strings(None, SUBSET_NAMESPACE, SUBSET_KEY), None);
        assert_eq!(
            metadata_strings(Some(&md(string_value(""))), SUBSET_NAMESPACE, SUBSET_KEY),
            Some(vec![])
        );
    }

    #[test]
    fn raw_value_wins_over_value() {
        let h = HeaderValue {
            key: "A".into(),
            value: "v".into(),
            raw_value: b"raw".to_vec(),
        };
        assert_eq!(header_bytes(&h), b"raw");
        let h = HeaderValue {
            key: "A".into(),
            value: "v".into(),
            raw_value: vec![],
        };
        assert_eq!(header_bytes(&h), b"v");
    }
}
