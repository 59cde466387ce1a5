//! A server on a runtime thread of its own, for tests.
//!
//! Tests that load a real engine (or any axum app) and then drive it from plain threads, or
//! from several `#[tokio::test]` runtimes in turn, need the server to outlive any one test's
//! runtime: it gets a Tokio runtime on a thread of its own. The port is bound before the
//! thread starts, so the address is known (and connectable) when this returns.

use std::net::SocketAddr;

/// Worker threads of the server's runtime: enough for a streamed answer and a scrape at once.
const WORKERS: usize = 2;

/// Serves `app` on a loopback port from a runtime on a thread of its own, keeping `keep` (what
/// the app's state needs alive: a loaded model, its services) for as long as it serves, which
/// is until the process ends. Returns the bound address.
pub fn serve_on_thread<K: Send + 'static>(
    app: axum::Router,
    keep: K,
) -> std::io::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(format!("serve {addr}"))
        .spawn(move || {
            rt.block_on(async move {
                let _keep = keep;
                // Registering the socket needs the runtime, so it is converted here.
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => {
                        if let Err(e) = axum::serve(listener, app).await {
                            tracing::error!("test server on {addr} stopped: {e}");
                        }
                    }
                    Err(e) => tracing::error!("test server on {addr} could not listen: {e}"),
                }
            });
        })?;
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn answers_at_once_and_outlives_the_caller_runtime() {
        let app = axum::Router::new().route("/ping", axum::routing::get(|| async { "pong" }));
        let addr = serve_on_thread(app, ()).expect("serve");
        let mut s = std::net::TcpStream::connect(addr).expect("connect at once");
        s.write_all(b"GET /ping HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .expect("write");
        let mut raw = String::new();
        s.read_to_string(&mut raw).expect("read");
        assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
        assert!(raw.ends_with("pong"), "{raw}");
    }
}
