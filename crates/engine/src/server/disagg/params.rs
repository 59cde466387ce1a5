//! `kv_transfer_params` both ways (PROTOCOLS §11): a request's params, or the
//! `x-prefiller-host-port` header an endpoint picker adds, checked at the edge into a
//! [`KvPlan`] (what cannot be honoured is a 400 naming the parameter); and the params a
//! prefill answer carries for its decoder.

use axum::http::HeaderMap;
use strata_api::types::KvTransferParams;
use strata_api::ApiError;

use crate::kv::peers::{check_host_port, split_host_port};
use crate::options::KvRole;
use crate::server::http::{random_id, request_id};
use crate::server::state::AppState;

/// The request header an endpoint picker names the prefill engine in (llm-d's).
const PREFILLER_HEADER: &str = "x-prefiller-host-port";
/// The `kv_transfer_params` extra field naming the pin a decoder releases.
pub(super) const REMOTE_REQUEST_ID: &str = "remote_request_id";
/// The parameter a refused peer is reported under.
const REMOTE_HOST: &str = "kv_transfer_params.remote_host";

/// What a request asked for, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::server) enum KvPlan {
    /// Colocated: local prefix hits, then the tier.
    Local,
    /// Prefill for a remote decoder: keep the prompt's blocks under this pin.
    Prefill { pin: String },
    /// The prompt's blocks wait on a prefill engine's transfer endpoint.
    Remote {
        host: String,
        port: u16,
        release: Option<String>,
    },
    /// Run phase 1 against this prefill engine's HTTP endpoint first, then pull.
    Prefiller {
        host: String,
        port: u16,
        request_id: String,
    },
}

/// Checks a request's `kv_transfer_params` and `x-prefiller-host-port` against what this
/// engine can do; what cannot be honoured is a 400 naming the parameter.
pub(in crate::server) fn plan(
    state: &AppState,
    params: Option<&KvTransferParams>,
    headers: &HeaderMap,
    stream: bool,
    n: u32,
    job_id: &str,
) -> Result<KvPlan, ApiError> {
    const P: &str = "kv_transfer_params";
    let header_id = request_id(headers);
    let Some(p) = params else {
        return prefiller_plan(state, headers, n, header_id);
    };
    if p.do_remote_decode && p.do_remote_prefill {
        return Err(ApiError::invalid(
            P,
            "kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill.",
        ));
    }
    if p.do_remote_decode {
        if stream {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_decode needs `stream: false` (the prefill answer \
                 carries the transfer parameters).",
            ));
        }
        if n > 1 {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_decode needs `n: 1`.",
            ));
        }
        if state.kv.role == KvRole::Decode {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_decode: this engine runs with --kv-role decode.",
            ));
        }
        if !state.kv.prefix_caching {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_decode: this engine runs without prefix caching, \
                 so it has no blocks to hand over.",
            ));
        }
        if state.kv.advertised().is_none() {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_decode: this engine has no KV transfer endpoint \
                 (start it with --kv-transfer-port).",
            ));
        }
        return Ok(KvPlan::Prefill {
            pin: header_id.unwrap_or_else(|| job_id.to_string()),
        });
    }
    if p.do_remote_prefill {
        let (Some(host), Some(port)) = (p.remote_host.as_deref(), p.remote_port) else {
            return Err(ApiError::invalid(
                P,
                "kv_transfer_params.do_remote_prefill needs remote_host and remote_port.",
            ));
        };
        check_host_port(host, port).map_err(|m| ApiError::invalid(P, m))?;
        let release = match p.extra.get(REMOTE_REQUEST_ID) {
            None | Some(serde_json::Value::Null) => header_id,
            Some(serde_json::Value::String(s)) if !s.is_empty() && s.len() <= 256 => {
                Some(s.clone())
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    P,
                    "kv_transfer_params.remote_request_id must be a non-empty string of at \
                     most 256 bytes.",
                ))
            }
        };
        // Last, once the params are well formed, and before anything connects: only a peer
        // this engine may contact.
        state
            .kv
            .check_peer(host, port)
            .map_err(|m| ApiError::invalid(REMOTE_HOST, m))?;
        return Ok(KvPlan::Remote {
            host: host.to_string(),
            port,
            release,
        });
    }
    Ok(KvPlan::Local)
}

/// The `x-prefiller-host-port` form: the picker chose a prefill engine and left phase 1 to
/// this (decode) engine.
fn prefiller_plan(
    state: &AppState,
    headers: &HeaderMap,
    n: u32,
    header_id: Option<String>,
) -> Result<KvPlan, ApiError> {
    let Some(value) = headers.get(PREFILLER_HEADER) else {
        return Ok(KvPlan::Local);
    };
    let bad = |m: String| ApiError::invalid(PREFILLER_HEADER, m);
    let text = value
        .to_str()
        .map_err(|_| bad(format!("{PREFILLER_HEADER} is not ASCII text.")))?;
    let (host, port) = split_host_port(text.trim()).ok_or_else(|| {
        bad(format!(
            "{PREFILLER_HEADER} must be `host:port`, got `{}`.",
            text.chars().take(80).collect::<String>()
        ))
    })?;
    check_host_port(&host, port).map_err(bad)?;
    state.kv.check_peer(&host, port).map_err(bad)?;
    // Several choices cannot share one prefill's pin, and an engine without prefix caching
    // cannot take blocks in: serve those colocated, which is always correct.
    if n > 1 || !state.kv.prefix_caching {
        return Ok(KvPlan::Local);
    }
    let request_id = header_id.unwrap_or_else(|| random_id("pd"));
    Ok(KvPlan::Prefiller {
        host,
        port,
        request_id,
    })
}

/// The answer's `kv_transfer_params` for a request prefilled for a remote decoder.
pub(in crate::server) fn prefill_answer(
    state: &AppState,
    pin: &str,
    blocks: &[u32],
) -> KvTransferParams {
    let (host, port) = state.kv.advertised().unzip();
    let mut extra = serde_json::Map::new();
    extra.insert(REMOTE_REQUEST_ID.into(), pin.into());
    KvTransferParams {
        do_remote_decode: false,
        do_remote_prefill: true,
        remote_engine_id: Some(state.kv.engine_id.clone()),
        remote_block_ids: Some(blocks.iter().map(|&b| b as u64).collect()),
        remote_host: host,
        remote_port: port,
        extra,
    }
}
