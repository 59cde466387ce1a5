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
    serve_on_thread_with(|| Ok((app, keep, ()))).map(|(addr, ())| addr)
}

/// [`serve_on_thread`] for an app whose state starts tasks or listeners of its own (an
/// engine's KV services): `setup` runs inside the server's runtime before it serves, and
/// returns the app, what to keep alive, and what the caller gets back beside the address.
pub fn serve_on_thread_with<K: Send + 'static, T>(
    setup: impl FnOnce() -> std::io::Result<(axum::Router, K, T)>,
) -> std::io::Result<(SocketAddr, T)> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .enable_all()
        .build()?;
    let (app, keep, out) = {
        let _inside = rt.enter();
        setup()?
    };
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
    Ok((addr, out))
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

    #[test]
    fn setup_runs_inside_the_runtime_and_its_tasks_keep_running() {
        // A listener of the app's own, served by a task the setup spawns: it needs the
        // server's runtime, and must outlive the setup.
        let (addr, side) = serve_on_thread_with(|| {
            let side = std::net::TcpListener::bind("127.0.0.1:0")?;
            side.set_nonblocking(true)?;
            let side_addr = side.local_addr()?;
            let side = tokio::net::TcpListener::from_std(side)?;
            tokio::spawn(async move {
                while let Ok((mut conn, _)) = side.accept().await {
                    use tokio::io::AsyncWriteExt;
                    let _ = conn.write_all(b"side").await;
                }
            });
            let app = axum::Router::new().route("/ping", axum::routing::get(|| async { "pong" }));
            Ok((app, (), side_addr))
        })
        .expect("serve");
        let mut s = std::net::TcpStream::connect(addr).expect("connect the app");
        s.write_all(b"GET /ping HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .expect("write");
        let mut raw = String::new();
        s.read_to_string(&mut raw).expect("read");
        assert!(raw.ends_with("pong"), "{raw}");
        let mut got = String::new();
        std::net::TcpStream::connect(side)
            .expect("connect the side listener")
            .read_to_string(&mut got)
            .expect("read");
        assert_eq!(got, "side");
    }

    #[test]
    fn a_failing_setup_is_returned() {
        let err = serve_on_thread_with::<(), ()>(|| Err(std::io::Error::other("no model")))
            .expect_err("the setup failed");
        assert_eq!(err.to_string(), "no model");
    }
}
