//! The sampling and output fields that chat and completion requests share, written once.
//!
//! `/v1/chat/completions` and `/v1/completions` take the same thirty-odd sampling,
//! streaming and structured-output fields. They are listed here once, with their docs, and
//! [`sampling_request!`] declares them into both request structs as ordinary fields.
//! Ordinary fields rather than a `#[serde(flatten)]`ed struct: flattening sends the whole
//! body through serde's buffered map, which changes how unknown fields, duplicate keys and
//! numbers are handled, what a parse error says (and which field
//! [`parse_json`](crate::validate::parse_json) can blame), and copies every field on the
//! way. With the list expanded in place, both requests stay plain derived structs and
//! their wire format is exactly that of hand-written fields.
//!
//! The shared fields come in runs, in the order they have always had: each endpoint's own
//! fields sit between the runs (chat's `logprobs` after `seed`, ...), so serialization
//! keeps its key order and the positional (JSON array) form of a request its positions.
//!
//! The same list declares [`SamplingFields`], the shared fields moved out of either
//! request, which `crate::validate` reads so that every field is checked by one piece of
//! code.

/// Declares a request struct with the shared fields. The caller writes its own fields in
/// four places: before the shared ones and `after_seed`, `after_stream_options` and
/// `after_cache_salt`; each of its own fields carries its own attributes, while every
/// shared field is an `Option` omitted from the output when `None`. Also declares
/// `take_sampling_fields`, which moves the shared fields out for validation.
macro_rules! sampling_request {
    // The list, written once: the runs of shared fields in wire order, handed on to the
    // arm named first. The last run is forwarded by the servers, never validated, so
    // `SamplingFields` leaves it out.
    (@with_list $($then:tt)*) => {
        $crate::types::sampling::sampling_request! { $($then)*
            [
                // --- OpenAI sampling and output fields ---
                /// 0..=2; 0 means greedy.
                temperature: Option<f64>,
                /// Nucleus sampling mass, (0, 1].
                top_p: Option<f64>,
                /// Number of choices.
                n: Option<i64>,
                /// Stop strings.
                stop: Option<$crate::types::common::Stop>,
                /// Output token limit (default: the rest of the context). OpenAI deprecated
                /// it for chat in favour of `max_completion_tokens`; clients still send it
                /// widely.
                max_tokens: Option<i64>,
                /// Output token limit; wins over `max_tokens`. Chat's current name,
                /// accepted by completions for symmetry.
                max_completion_tokens: Option<i64>,
                /// Any JSON integer (signed or unsigned 64-bit).
                seed: Option<::serde_json::Number>,
            ]
            [
                /// -2..=2.
                presence_penalty: Option<f64>,
                /// -2..=2.
                frequency_penalty: Option<f64>,
                /// Token id (as a string) to additive bias, -100..=100.
                logit_bias: Option<::std::collections::BTreeMap<String, f64>>,
                /// Output format: `text`, `json_object` or `json_schema`.
                response_format: Option<$crate::types::common::ResponseFormat>,
                /// End-user id, for logs.
                user: Option<String>,
                /// Stream Server-Sent Events.
                stream: Option<bool>,
                /// Streaming options (only with `stream: true`).
                stream_options: Option<$crate::types::common::StreamOptions>,
            ]
            [
                // --- vLLM extensions ---
                /// -1 or 0 disables; otherwise sample among the k most likely tokens.
                top_k: Option<i64>,
                /// Minimum probability relative to the most likely token, 0..=1.
                min_p: Option<f64>,
                /// Multiplicative penalty on repeated tokens; 1 disables.
                repetition_penalty: Option<f64>,
                /// Token ids that end a choice.
                stop_token_ids: Option<Vec<i64>>,
                /// Keep the matched stop string in the output.
                include_stop_str_in_output: Option<bool>,
                /// Keep generating past EOS.
                ignore_eos: Option<bool>,
                /// Do not stop (on EOS or stop tokens) before this many tokens.
                min_tokens: Option<i64>,
                /// Drop special tokens when detokenizing (default true).
                skip_special_tokens: Option<bool>,
                /// Put spaces between special tokens when detokenizing (default true).
                spaces_between_special_tokens: Option<bool>,
                /// Scheduling priority; lower runs earlier (vLLM's convention).
                priority: Option<i64>,
                /// Salt mixed into prefix-cache hashes so tenants do not share cache entries.
                cache_salt: Option<String>,
            ]
            [
                /// vLLM: constrain the output to JSON matching this schema (an object, or a
                /// JSON string holding one).
                guided_json: Option<::serde_json::Value>,
                /// vLLM: constrain the output to this regular expression.
                guided_regex: Option<String>,
                /// vLLM: the output is exactly one of these strings.
                guided_choice: Option<Vec<String>>,
                /// vLLM: a context-free grammar (refused: not supported).
                guided_grammar: Option<String>,
                /// vLLM's newer spelling of the guided fields: `{"json" | "regex" | "choice" |
                /// "json_object": ...}`, kept raw for validation.
                structured_outputs: Option<::serde_json::Value>,
                /// Strata: `false` opts this request out of speculative decoding (default:
                /// the engine's setting).
                speculative: Option<bool>,
            ]
            forwarded [
                /// vLLM: prefill/decode disaggregation (PROTOCOLS §11).
                kv_transfer_params: Option<$crate::types::common::KvTransferParams>,
            ]
        }
    };

    // A request struct: its own fields and the runs, interleaved in wire order.
    (
        @request
        $(#[$meta:meta])*
        $name:ident { $($head:tt)* }
        { $($after_seed:tt)* }
        { $($after_stream_options:tt)* }
        { $($after_cache_salt:tt)* }
        $([ $( $(#[$doc:meta])* $field:ident : $ty:ty, )* ])*
        forwarded [ $( $(#[$fwd_doc:meta])* $fwd:ident : $fwd_ty:ty, )* ]
    ) => {
        $crate::types::sampling::sampling_request! { @interleave
            $(#[$meta])* $name
            { $($head)* }
            [ { $($after_seed)* } { $($after_stream_options)* } { $($after_cache_salt)* } {} ]
            $([ $( $(#[$doc])* $field : $ty, )* ])*
            forwarded [ $( $(#[$fwd_doc])* $fwd : $fwd_ty, )* ]
        }
        impl $name {
            /// Moves the shared sampling and output fields out, for validation.
            pub(crate) fn take_sampling_fields(&mut self) -> $crate::types::sampling::SamplingFields {
                $crate::types::sampling::SamplingFields {
                    $($( $field: self.$field.take(), )*)*
                }
            }
        }
    };

    // The struct itself: run 1, the caller's first slot, run 2, ... (four runs, four
    // slots, the last slot empty), then the forwarded run.
    (
        @interleave
        $(#[$meta:meta])* $name:ident
        { $($head:tt)* }
        [ $( { $($slot:tt)* } )* ]
        $([ $( $(#[$doc:meta])* $field:ident : $ty:ty, )* ])*
        forwarded [ $( $(#[$fwd_doc:meta])* $fwd:ident : $fwd_ty:ty, )* ]
    ) => {
        $(#[$meta])*
        pub struct $name {
            $($head)*
            $(
                $(
                    $(#[$doc])*
                    #[serde(skip_serializing_if = "Option::is_none")]
                    pub $field: $ty,
                )*
                $($slot)*
            )*
            $(
                $(#[$fwd_doc])*
                #[serde(skip_serializing_if = "Option::is_none")]
                pub $fwd: $fwd_ty,
            )*
        }
    };

    // `SamplingFields`: the runs that validation reads.
    (
        @fields
        $([ $( $(#[$doc:meta])* $field:ident : $ty:ty, )* ])*
        forwarded [ $($forwarded:tt)* ]
    ) => {
        /// The shared sampling and output fields of a chat or completion request, moved out
        /// of it (`take_sampling_fields`) so that one validation reads them for both.
        #[derive(Debug, Default)]
        pub(crate) struct SamplingFields {
            $($(
                $(#[$doc])*
                pub $field: $ty,
            )*)*
        }
    };

    // What the request files write.
    (
        $(#[$meta:meta])*
        pub struct $name:ident { $($head:tt)* }
        after_seed { $($after_seed:tt)* }
        after_stream_options { $($after_stream_options:tt)* }
        after_cache_salt { $($after_cache_salt:tt)* }
    ) => {
        $crate::types::sampling::sampling_request! { @with_list @request
            $(#[$meta])*
            $name { $($head)* }
            { $($after_seed)* }
            { $($after_stream_options)* }
            { $($after_cache_salt)* }
        }
    };
}
pub(crate) use sampling_request;

sampling_request! { @with_list @fields }
