//! An engine served in process with its KV services: the harness of the KV-transfer tests
//! (plain and over TLS).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

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
    let (tx, rx) = std::sync::mpsc::channel();
    let st = state.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let http = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind http");
            let transfer = if endpoint {
                Some(
                    tokio::net::TcpListener::bind("127.0.0.1:0")
                        .await
                        .expect("bind transfer"),
                )
            } else {
                None
            };
            let services =
                server::start_kv_services(&st, transfer, "127.0.0.1").expect("KV services");
            tx.send((http.local_addr().expect("addr"), services.transfer_addr()))
                .expect("send addrs");
            let _keep = (services, loaded);
            axum::serve(http, server::router(st)).await.expect("serve");
        });
    });
    let (http, transfer) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("engine addresses");
    Engine {
        http,
        transfer,
        state,
    }
}
