//! Scraping live engines (the shared mock engine) of every kind, and what a failing
//! replica does to the sample.

use std::time::Duration;

use strata_controller::driver::{ReplicaInfo, ReplicaPhase};
use strata_controller::signals::{EngineKind, MetricsScraper, SignalSource};
use strata_mock::{Fault, MockConfig, MockEngine};

fn info(id: &str, url: String) -> ReplicaInfo {
    ReplicaInfo {
        id: id.into(),
        url,
        phase: ReplicaPhase::Ready,
    }
}

async fn mock(kind: strata_mock::EngineKind) -> MockEngine {
    MockEngine::spawn(MockConfig {
        model: "m".into(),
        kind,
        block_size: 16,
        num_blocks: 100,
        ..MockConfig::default()
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn every_engine_kind_is_read() {
    for (mk, kind, has_kv) in [
        (strata_mock::EngineKind::Vllm, EngineKind::Vllm, true),
        (strata_mock::EngineKind::Sglang, EngineKind::Sglang, true),
        (strata_mock::EngineKind::Trtllm, EngineKind::Trtllm, true),
        (
            strata_mock::EngineKind::Llamacpp,
            EngineKind::Llamacpp,
            false,
        ),
    ] {
        let e = mock(mk).await;
        e.set_gauges(3, 5, 0.5);
        let s = MetricsScraper::new(kind, Duration::from_secs(2));
        let m = s.scrape(&e.url()).await.unwrap();
        assert_eq!((m.waiting, m.running), (3.0, 5.0), "{kind:?}");
        assert_eq!(m.kv_use.is_some(), has_kv, "{kind:?}");
        e.shutdown().await;
    }
}

#[tokio::test]
async fn replicas_are_summed_and_a_failing_one_makes_the_sample_partial() {
    let a = mock(strata_mock::EngineKind::Vllm).await;
    let b = mock(strata_mock::EngineKind::Vllm).await;
    a.set_gauges(2, 4, 0.25);
    b.set_gauges(6, 8, 0.75);
    let ready = vec![info("a", a.url()), info("b", b.url())];
    let mut s = MetricsScraper::new(EngineKind::Vllm, Duration::from_millis(500));
    let load = s.collect(&ready).await.unwrap();
    assert_eq!((load.waiting, load.running), (8.0, 12.0));
    assert_eq!(load.kv_usage, Some(0.5));
    // kv x blocks x block size, summed: 0.25*100*16 + 0.75*100*16.
    assert_eq!(load.inflight_tokens, Some(1600.0));
    assert!(s.partial().is_none());

    for fault in [Fault::GarbageMetrics, Fault::HangMetrics] {
        b.set_fault(fault);
        assert!(
            s.collect(&ready).await.is_none(),
            "never a partial sum as the load"
        );
        let p = s.partial().unwrap();
        assert_eq!((p.waiting, p.running), (2.0, 4.0));
    }
    b.set_fault(Fault::None);
    assert!(s.collect(&ready).await.is_some());

    // A replica that is gone.
    b.shutdown().await;
    assert!(s.collect(&ready).await.is_none());
    assert!(s.failures >= 3);
    // Nobody answers: no partial either.
    a.shutdown().await;
    assert!(s.collect(&ready).await.is_none());
    assert!(s.partial().is_none());
    // No ready replicas: the load is known to be zero.
    assert_eq!(s.collect(&[]).await.unwrap().concurrency(), 0.0);
}
