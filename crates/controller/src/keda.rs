//! The KEDA external scaler (gRPC `externalscaler.ExternalScaler`, PROTOCOLS §7), so a
//! KEDA / HPA setup scales on Strata's judgement instead of its own.
//!
//! The metric is the controller's desired replica count, declared with a per-replica
//! target of 1: the HPA computes `ceil(value / target)` = the desired count, and KEDA's
//! `IsActive` (desired > 0) drives 0 ↔ 1. The messages are written out as prost structs
//! with the proto's field numbers, so the build needs no `protoc`.

// tonic's own API returns `Result<_, tonic::Status>`; boxing it here would only convert back.
#![allow(clippy::result_large_err)]

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::codegen::{http, Body, BoxFuture, StdError};
use tonic::{Request, Response, Status};

use crate::controller::Status as ControllerStatus;

/// The gRPC service name.
pub const SERVICE: &str = "externalscaler.ExternalScaler";
/// The metric name `GetMetricSpec` declares.
pub const METRIC_NAME: &str = "strata_desired_replicas";

/// `ScaledObjectRef`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ScaledObjectRef {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(map = "string, string", tag = "3")]
    pub scaler_metadata: std::collections::HashMap<String, String>,
}

/// `IsActiveResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct IsActiveResponse {
    #[prost(bool, tag = "1")]
    pub result: bool,
}

/// `MetricSpec`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct MetricSpec {
    #[prost(string, tag = "1")]
    pub metric_name: String,
    /// Deprecated integer target; filled too for older KEDA releases.
    #[prost(int64, tag = "2")]
    pub target_size: i64,
    #[prost(double, tag = "3")]
    pub target_size_float: f64,
}

/// `GetMetricSpecResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GetMetricSpecResponse {
    #[prost(message, repeated, tag = "1")]
    pub metric_specs: Vec<MetricSpec>,
}

/// `GetMetricsRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GetMetricsRequest {
    #[prost(message, optional, tag = "1")]
    pub scaled_object_ref: Option<ScaledObjectRef>,
    #[prost(string, tag = "2")]
    pub metric_name: String,
}

/// `MetricValue`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct MetricValue {
    #[prost(string, tag = "1")]
    pub metric_name: String,
    /// Deprecated integer value; filled too for older KEDA releases.
    #[prost(int64, tag = "2")]
    pub metric_value: i64,
    #[prost(double, tag = "3")]
    pub metric_value_float: f64,
}

/// `GetMetricsResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GetMetricsResponse {
    #[prost(message, repeated, tag = "1")]
    pub metric_values: Vec<MetricValue>,
}

/// Answers KEDA from the controller's last decision.
#[derive(Clone)]
pub struct KedaScaler {
    status: Arc<Mutex<ControllerStatus>>,
    /// How often `StreamIsActive` re-sends the activity.
    stream_interval: Duration,
}

impl KedaScaler {
    pub fn new(status: Arc<Mutex<ControllerStatus>>, stream_interval: Duration) -> KedaScaler {
        KedaScaler {
            status,
            stream_interval,
        }
    }

    /// The desired replica count, or `None` before the first decision.
    fn desired(&self) -> Option<u32> {
        self.status
            .lock()
            .ok()
            .and_then(|s| s.last.as_ref().map(|l| l.decision.desired))
    }

    fn is_active(&self) -> IsActiveResponse {
        IsActiveResponse {
            result: self.desired().is_some_and(|d| d > 0),
        }
    }

    fn metric_spec(&self) -> GetMetricSpecResponse {
        GetMetricSpecResponse {
            metric_specs: vec![MetricSpec {
                metric_name: METRIC_NAME.to_string(),
                target_size: 1,
                target_size_float: 1.0,
            }],
        }
    }

    fn metrics(&self, req: &GetMetricsRequest) -> Result<GetMetricsResponse, Status> {
        if !req.metric_name.is_empty() && req.metric_name != METRIC_NAME {
            return Err(Status::not_found(format!(
                "unknown metric `{}`; this scaler serves `{METRIC_NAME}`",
                req.metric_name
            )));
        }
        let desired = self
            .desired()
            .ok_or_else(|| Status::unavailable("the controller has not decided yet"))?;
        Ok(GetMetricsResponse {
            metric_values: vec![MetricValue {
                metric_name: METRIC_NAME.to_string(),
                metric_value: i64::from(desired),
                metric_value_float: f64::from(desired),
            }],
        })
    }

    /// The tonic service to add to a server.
    pub fn into_service(self) -> KedaService {
        KedaService {
            scaler: Arc::new(self),
        }
    }
}

/// `ExternalScaler` as a tower service (what protoc would have generated).
#[derive(Clone)]
pub struct KedaService {
    scaler: Arc<KedaScaler>,
}

impl tonic::server::NamedService for KedaService {
    const NAME: &'static str = SERVICE;
}

/// A unary method backed by a plain function of the scaler.
struct Unary<Req, Resp> {
    scaler: Arc<KedaScaler>,
    f: fn(&KedaScaler, Req) -> Result<Resp, Status>,
}

impl<Req: Send + 'static, Resp: Send + 'static> tonic::server::UnaryService<Req>
    for Unary<Req, Resp>
{
    type Response = Resp;
    type Future = BoxFuture<Response<Resp>, Status>;
    fn call(&mut self, request: Request<Req>) -> Self::Future {
        let out = (self.f)(&self.scaler, request.into_inner()).map(Response::new);
        Box::pin(async move { out })
    }
}

type ActiveStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<IsActiveResponse, Status>> + Send>>;

/// `StreamIsActive`: the activity now, then every interval.
struct StreamActive {
    scaler: Arc<KedaScaler>,
}

impl tonic::server::ServerStreamingService<ScaledObjectRef> for StreamActive {
    type Response = IsActiveResponse;
    type ResponseStream = ActiveStream;
    type Future = BoxFuture<Response<ActiveStream>, Status>;
    fn call(&mut self, _request: Request<ScaledObjectRef>) -> Self::Future {
        let scaler = self.scaler.clone();
        let interval = scaler.stream_interval;
        let stream = tokio_stream::StreamExt::map(
            tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(interval)),
            move |_| Ok(scaler.is_active()),
        );
        Box::pin(async move { Ok(Response::new(Box::pin(stream) as ActiveStream)) })
    }
}

fn path(method: &str) -> String {
    format!("/{SERVICE}/{method}")
}

impl<B> tonic::codegen::Service<http::Request<B>> for KedaService
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let scaler = self.scaler.clone();
        let p = req.uri().path().to_string();
        fn codec<Q, R>() -> tonic::codec::ProstCodec<Q, R> {
            tonic::codec::ProstCodec::default()
        }
        let fut: Pin<Box<dyn Future<Output = http::Response<tonic::body::Body>> + Send>> =
            if p == path("IsActive") {
                let svc = Unary {
                    scaler,
                    f: |s: &KedaScaler, _: ScaledObjectRef| Ok(s.is_active()),
                };
                Box::pin(async move {
                    tonic::server::Grpc::new(codec::<IsActiveResponse, ScaledObjectRef>())
                        .unary(svc, req)
                        .await
                })
            } else if p == path("GetMetricSpec") {
                let svc = Unary {
                    scaler,
                    f: |s: &KedaScaler, _: ScaledObjectRef| Ok(s.metric_spec()),
                };
                Box::pin(async move {
                    tonic::server::Grpc::new(codec::<GetMetricSpecResponse, ScaledObjectRef>())
                        .unary(svc, req)
                        .await
                })
            } else if p == path("GetMetrics") {
                let svc = Unary {
                    scaler,
                    f: |s: &KedaScaler, r: GetMetricsRequest| s.metrics(&r),
                };
                Box::pin(async move {
                    tonic::server::Grpc::new(codec::<GetMetricsResponse, GetMetricsRequest>())
                        .unary(svc, req)
                        .await
                })
            } else if p == path("StreamIsActive") {
                let svc = StreamActive { scaler };
                Box::pin(async move {
                    tonic::server::Grpc::new(codec::<IsActiveResponse, ScaledObjectRef>())
                        .server_streaming(svc, req)
                        .await
                })
            } else {
                Box::pin(async move { Status::unimplemented(format!("no method {p}")).into_http() })
            };
        Box::pin(async move { Ok(fut.await) })
    }
}

/// Serves the scaler on `listener` until `shutdown` resolves.
pub async fn serve(
    scaler: KedaScaler,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(scaler.into_service())
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoscale::{decide, AutoscaleConfig, Load, Signals, State};
    use crate::controller::TickReport;
    use tonic::codegen::http::uri::PathAndQuery;

    async fn start(
        status: Arc<Mutex<ControllerStatus>>,
    ) -> (String, tokio::sync::oneshot::Sender<()>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let scaler = KedaScaler::new(status, Duration::from_millis(20));
        tokio::spawn(serve(scaler, l, async move {
            let _ = rx.await;
        }));
        (format!("http://{addr}"), tx)
    }

    async fn client(url: String) -> tonic::client::Grpc<tonic::transport::Channel> {
        let ch = tonic::transport::Endpoint::from_shared(url)
            .unwrap()
            .connect()
            .await
            .unwrap();
        tonic::client::Grpc::new(ch)
    }

    async fn unary<Q, R>(
        g: &mut tonic::client::Grpc<tonic::transport::Channel>,
        method: &'static str,
        q: Q,
    ) -> Result<R, Status>
    where
        Q: prost::Message + Send + Sync + 'static,
        R: prost::Message + Default + Send + Sync + 'static,
    {
        g.ready().await.unwrap();
        let p = PathAndQuery::try_from(path(method)).unwrap();
        g.unary(
            Request::new(q),
            p,
            tonic::codec::ProstCodec::<Q, R>::default(),
        )
        .await
        .map(|r| r.into_inner())
    }

    fn status_with(desired_load: f64, current: u32) -> TickReport {
        let (d, _) = decide(
            &AutoscaleConfig {
                min_replicas: 0,
                ..AutoscaleConfig::default()
            },
            &State::new(current),
            &Signals {
                ready: current,
                load: Some(Load {
                    running: desired_load,
                    ..Load::default()
                }),
                partial: None,
                held_requests: 0,
            },
            Duration::ZERO,
        );
        TickReport {
            decision: d,
            events: vec![],
            driver_error: None,
        }
    }

    #[tokio::test]
    async fn keda_reads_the_controllers_judgement() {
        let status = Arc::new(Mutex::new(ControllerStatus::default()));
        let (url, stop) = start(status.clone()).await;
        let mut g = client(url).await;
        let obj = ScaledObjectRef {
            name: "strata".into(),
            namespace: "default".into(),
            ..Default::default()
        };

        // Before any decision: inactive, and metrics are unavailable rather than made up.
        let r: IsActiveResponse = unary(&mut g, "IsActive", obj.clone()).await.unwrap();
        assert!(!r.result);
        let e = unary::<_, GetMetricsResponse>(&mut g, "GetMetrics", GetMetricsRequest::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable);

        let spec: GetMetricSpecResponse =
            unary(&mut g, "GetMetricSpec", obj.clone()).await.unwrap();
        assert_eq!(spec.metric_specs[0].metric_name, METRIC_NAME);
        assert_eq!(spec.metric_specs[0].target_size_float, 1.0);

        // 20 in flight on one replica: the controller wants 3.
        status.lock().unwrap().last = Some(status_with(20.0, 1));
        let r: IsActiveResponse = unary(&mut g, "IsActive", obj.clone()).await.unwrap();
        assert!(r.result);
        let m: GetMetricsResponse = unary(
            &mut g,
            "GetMetrics",
            GetMetricsRequest {
                scaled_object_ref: Some(obj.clone()),
                metric_name: METRIC_NAME.into(),
            },
        )
        .await
        .unwrap();
        assert_eq!(m.metric_values[0].metric_value_float, 3.0);
        assert_eq!(m.metric_values[0].metric_value, 3);

        let e = unary::<_, GetMetricsResponse>(
            &mut g,
            "GetMetrics",
            GetMetricsRequest {
                scaled_object_ref: None,
                metric_name: "cpu".into(),
            },
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);

        let e = unary::<_, IsActiveResponse>(&mut g, "Nope", obj.clone())
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unimplemented);

        // The stream sends the activity repeatedly.
        g.ready().await.unwrap();
        let mut s = g
            .server_streaming(
                Request::new(obj),
                PathAndQuery::try_from(path("StreamIsActive")).unwrap(),
                tonic::codec::ProstCodec::<ScaledObjectRef, IsActiveResponse>::default(),
            )
            .await
            .unwrap()
            .into_inner();
        for _ in 0..2 {
            let m = s.message().await.unwrap().unwrap();
            assert!(m.result);
        }
        let _ = stop.send(());
    }
}
