//! Fields through which a request names *where* an engine connects, removed from every
//! client's body before it is forwarded. `kv_transfer_params` is the engines' own
//! disaggregation protocol (vLLM's P/D connector fields: `do_remote_prefill` with
//! `remote_host`/`remote_port`, block and engine ids): an engine that reads it opens a
//! connection to the host it names. Only Strata's routers may set it, and the gateway's
//! clients are never those routers, so the whole object goes. The `x-prefiller-*` headers
//! that carry the same facts between router and engine never travel: the gateway forwards
//! no client header upstream.

use serde_json::Value;

/// The body field that carries the engines' KV-transfer (disaggregation) parameters.
pub(crate) const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// Removes a client's `kv_transfer_params`; true when there was one (the body must then
/// be re-serialized instead of forwarded as received).
pub(crate) fn strip_client_placement(body: &mut Value) -> bool {
    body.as_object_mut()
        .and_then(|o| o.remove(KV_TRANSFER_PARAMS))
        .is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_a_present_field_is_removed() {
        let mut body = json!({"model": "m", "kv_transfer_params": {"do_remote_prefill": true,
            "remote_host": "10.0.0.9", "remote_port": 5557}});
        assert!(strip_client_placement(&mut body));
        assert_eq!(body, json!({"model": "m"}));
        assert!(!strip_client_placement(&mut body));
    }
}
