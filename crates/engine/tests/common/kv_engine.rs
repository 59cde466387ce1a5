//! An engine served in process with its KV services: the harness of the KV-transfer tests
//! (plain and over TLS).

use std::net::SocketAddr;
use std::sync::Arc;

use strata_engine::server::{self, AppState, EngineOptions};

use super::model_path;

/// The model name the engines serve.
pub const MODEL: &str = "smollm2-135m-instruct";

/// An engine served in process: its HTTP address, its transfer endpoint (when it has one)
/// and its state, for looking inside.
pub struct Engine {
    pub http: SocketAddr,
    pub transfer: Option<SocketAddr>,
    pub state: Arc<AppState>,
}

/// Loads the default model with `opts` and serves it on a runtime thread of its own, with a
/// transfer endpoint on a loopback port when `endpoint` is set.
pub fn start(opts: EngineOptions, endpoint: bool) -> Engine {
    let loaded = server::load(&EngineOptions {
        model_path: model_path(),
        model_name: MODEL.into(),
        ..opts
    })
    .expect("load the model");
    let state = loaded.state.clone();
    let st = state.clone();
    let (http, transfer) = strata_mock::serve_on_thread_with(move || {
        let transfer = if endpoint {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            l.set_nonblocking(true)?;
            Some(tokio::net::TcpListener::from_std(l)?)
        } else {
            None
        };
        let services = server::start_kv_services(&st, transfer, "127.0.0.1")?;
        let transfer = services.transfer_addr();
        Ok((server::router(st), (services, loaded), transfer))
    })
    .expect("serve the engine");
    Engine {
        http,
        transfer,
        state,
    }
}
