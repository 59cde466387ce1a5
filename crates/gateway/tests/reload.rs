//! Hot reload: a changed `gateway.yaml` is picked up while serving; an invalid one is
//! rejected and the previous config keeps serving.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use strata_gateway::store::sqlite::SqliteStore;
use strata_gateway::{ConfigHandle, Gateway, GatewayOptions};

async fn models(url: &str, key: &str) -> Vec<String> {
    let v: serde_json::Value = client()
        .get(format!("{url}/v1/models"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn file_change_reloads_and_invalid_file_is_rejected() {
    let m = mock("m").await;
    let dir = std::env::temp_dir().join(format!("strata-gw-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gateway.yaml");
    std::fs::write(&path, yaml_one(&m.url(), "m", "", "")).unwrap();
    let gw = Gateway::new(
        Arc::new(ConfigHandle::open(Some(&path)).unwrap()),
        Arc::new(SqliteStore::in_memory().unwrap()),
        GatewayOptions {
            admin_key: Some(ADMIN.into()),
            seed: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    let running = strata_gateway::spawn(gw, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let k = key(&running, "t");
    assert_eq!(models(&running.url(), &k).await, ["m"]);

    // Make sure the new file gets a different mtime even on coarse clocks.
    tokio::time::sleep(Duration::from_millis(20)).await;
    std::fs::write(&path, yaml_one(&m.url(), "m", "    aliases: [m2]", "")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while models(&running.url(), &k).await != ["m", "m2"] {
        assert!(Instant::now() < deadline, "reload not picked up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    tokio::time::sleep(Duration::from_millis(20)).await;
    std::fs::write(&path, "models: [{name: broken}]").unwrap();
    let resp = client()
        .post(format!("{}/admin/reload", running.url()))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400, "the invalid file is refused");
    assert_eq!(
        models(&running.url(), &k).await,
        ["m", "m2"],
        "old config kept"
    );
    let (status, _, _) = post(
        &format!("{}/v1/chat/completions", running.url()),
        Some(&k),
        &chat_body("m2"),
    )
    .await;
    assert_eq!(status, 200);
    running.shutdown().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn sighup_reloads_even_when_the_mtime_did_not_change() {
    let m = mock("m").await;
    let dir = std::env::temp_dir().join(format!("strata-gw-hup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gateway.yaml");
    std::fs::write(&path, yaml_one(&m.url(), "m", "", "")).unwrap();
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let gw = Gateway::new(
        Arc::new(ConfigHandle::open(Some(&path)).unwrap()),
        Arc::new(SqliteStore::in_memory().unwrap()),
        GatewayOptions {
            admin_key: Some(ADMIN.into()),
            seed: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    let running = strata_gateway::spawn(gw, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let k = key(&running, "t");
    std::fs::write(&path, yaml_one(&m.url(), "m", "    aliases: [hup]", "")).unwrap();
    // Put the old mtime back: only the signal can trigger this reload.
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        models(&running.url(), &k).await,
        ["m"],
        "no reload without a trigger"
    );
    let status = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while models(&running.url(), &k).await != ["hup", "m"] {
        assert!(Instant::now() < deadline, "SIGHUP reload not picked up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.shutdown().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A loopback port with nothing listening on it (bound, then released).
fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[tokio::test]
async fn a_reload_applies_the_rate_limiters_failure_mode() {
    let m = mock("m").await;
    let dir = std::env::temp_dir().join(format!("strata-gw-reload-mode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gateway.yaml");
    let port = dead_port();
    let limits = |mode: &str| {
        format!("limits: {{backend: redis, redis_url: \"redis://127.0.0.1:{port}/\", on_backend_error: {mode}, redis_timeout_ms: 200, default_key: {{rpm: 1000}}}}")
    };
    std::fs::write(&path, yaml_one(&m.url(), "m", "", &limits("open"))).unwrap();
    let gw = Gateway::new(
        Arc::new(ConfigHandle::open(Some(&path)).unwrap()),
        Arc::new(SqliteStore::in_memory().unwrap()),
        GatewayOptions {
            admin_key: Some(ADMIN.into()),
            seed: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    let running = strata_gateway::spawn(gw, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let k = key(&running, "t");
    let chat = format!("{}/v1/chat/completions", running.url());
    let (status, _, body) = post(&chat, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 200, "open admits while Redis is down: {body}");

    tokio::time::sleep(Duration::from_millis(20)).await;
    std::fs::write(&path, yaml_one(&m.url(), "m", "", &limits("closed"))).unwrap();
    let resp = client()
        .post(format!("{}/admin/reload", running.url()))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let (status, _, body) = post(&chat, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 503, "closed after the reload: {body}");

    // A key read only at start is refused by name, not reported as reloaded.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let moved = limits("closed").replace(&port.to_string(), &dead_port().to_string());
    std::fs::write(&path, yaml_one(&m.url(), "m", "", &moved)).unwrap();
    let resp = client()
        .post(format!("{}/admin/reload", running.url()))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let text = resp.text().await.unwrap();
    assert!(text.contains("limits.redis_url"), "{text}");
    running.shutdown().await;
    std::fs::remove_dir_all(&dir).unwrap();
}
