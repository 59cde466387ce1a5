//! The HTTP header names the router reads and writes, in one place: both transports (the
//! HTTP front and the ext_proc picker) and the crates that embed the router name them from
//! here.

/// Request id header, propagated upstream and echoed back.
pub const REQUEST_ID: &str = "x-request-id";
/// GIE objective header: an objective name (mapped by `admission.objectives`) or an
/// integer priority.
pub const OBJECTIVE: &str = "x-gateway-inference-objective";
/// Chooses a scheduling profile by name.
pub const PROFILE: &str = "x-strata-scheduling-profile";
/// Names the endpoint that served (as in GIE's `x-gateway-destination-endpoint-served`).
pub const SERVED_BY: &str = "x-gateway-destination-endpoint-served";
/// On a disaggregated answer: the prefill engine (`host:port`) that computed the prompt.
pub const PREFILLED_BY: &str = "x-strata-prefilled-by";
/// The prefill engine of a disaggregated request, for the decode side (llm-d's header).
pub const PREFILLER: &str = "x-prefiller-host-port";
/// GIE header naming a model to send instead of the body's `model`.
pub const MODEL_REWRITE: &str = "x-gateway-model-name-rewrite";
/// GIE fairness key: the request's flow in flow control (`flow_control.flow_headers`).
pub const FAIRNESS_ID: &str = "x-gateway-inference-fairness-id";
/// Envoy's expected request timeout in milliseconds: a request's deadline in flow control
/// (`flow_control.deadline_header`).
pub const ENVOY_TIMEOUT: &str = "x-envoy-expected-rq-timeout-ms";
/// Conformance header restricting the pick to `ip[,ip]` (or `ip:port`).
pub const TEST_SELECTION: &str = "test-epp-endpoint-selection";
/// Every header of the prefill protocol starts with this; a client never sets one.
pub const PREFILLER_PREFIX: &str = "x-prefiller-";

/// Whether a header belongs to the prefill protocol (never trusted from a client: it
/// would make a decode engine prefill on a host the client chose).
pub fn is_prefiller(name: &str) -> bool {
    name.get(..PREFILLER_PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(PREFILLER_PREFIX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefiller_headers_are_recognised_by_prefix() {
        assert!(is_prefiller(PREFILLER));
        assert!(is_prefiller("X-Prefiller-Url"));
        assert!(!is_prefiller("x-prefill"));
        assert!(!is_prefiller("x-request-id"));
    }
}
