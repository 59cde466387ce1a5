//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// The default model: `$STRATA_TEST_MODEL`, else the cache entry that `strata model pull`
/// writes. A missing model fails the test with what to run; it is never skipped.
pub fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_TEST_MODEL") {
        return PathBuf::from(p);
    }
    let cache = strata_engine::model_cache::ModelCache::from_env();
    let path = cache.path_of(strata_engine::model_cache::DEFAULT_MODEL);
    assert!(
        path.is_file(),
        "the default model is missing at {}; run `cargo run -p strata-cli -- model pull` \
         (scripts/test.sh does this first)",
        path.display()
    );
    path
}

/// Serves the default model with `opts` on a loopback port, in process, on a runtime thread
/// of its own; returns the address once it is listening.
pub fn serve(opts: &strata_engine::server::EngineOptions) -> std::net::SocketAddr {
    use strata_engine::server;
    let loaded =
        server::load(&model_path(), "smollm2-135m-instruct", opts).expect("load the default model");
    let app = server::router(loaded.state.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            tx.send(listener.local_addr().expect("addr"))
                .expect("send addr");
            let _keep = std::sync::Arc::clone(&loaded.state);
            axum::serve(listener, app).await.expect("serve");
        });
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .expect("server address")
}
