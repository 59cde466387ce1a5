//! End-to-end behaviour of the proxy path against mock engines on loopback.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use strata_gateway::CreateKey;
use strata_mock::Fault;

#[tokio::test]
async fn chat_completion_passes_through_and_records_usage() {
    let OneModel {
        mock: m,
        gw,
        chat: url,
    } = one_model(
        "    price: {input_per_1m: 1000000, output_per_1m: 2000000}",
        "",
    )
    .await;
    let k = key(&gw, "team-a");
    let (status, headers, body) = post(&url, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 2);
    assert_eq!(body["usage"]["completion_tokens"], 8);
    assert_eq!(headers["x-strata-upstream"], "up");
    assert!(headers["x-request-id"].to_str().unwrap().starts_with("gw-"));
    assert_eq!(m.requests(), 1);
    let resp = client()
        .post(&url)
        .bearer_auth(&k)
        .header("x-request-id", "mine-1")
        .json(&chat_body("m"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-request-id"], "mine-1");
    drop(resp.text().await.unwrap());
    // $1 per input token, $2 per output token: 2 + 16 = $18 per request, two requests.
    let (s, usage) = admin_get(&gw, "/admin/usage").await;
    assert_eq!(s, 200);
    assert_eq!(usage["total_cost_micros"], 36_000_000, "{usage}");
    assert_eq!(usage["data"][0]["tenant"], "team-a");
    assert_eq!(usage["data"][0]["input_tokens"], 4);
    assert_eq!(usage["data"][0]["requests"], 2);
    // Prometheus counters (the tenant series with the metrics key).
    let text = metrics_text(&gw).await;
    assert!(
        text.contains(
            "strata_gateway_tokens_total{tenant=\"team-a\",model=\"m\",kind=\"output\"} 16"
        ),
        "{text}"
    );
    assert!(text.contains("strata_gateway_cost_usd_total"), "{text}");
    gw.shutdown().await;
}

#[tokio::test]
async fn no_valid_key_never_reaches_an_upstream_on_any_route() {
    let OneModel { mock: m, gw, .. } = one_model("", "").await;
    let good = key(&gw, "t");
    let url = gw.url();
    let bodies = [
        ("/v1/chat/completions", chat_body("m")),
        ("/v1/completions", json!({"model": "m", "prompt": "hi"})),
        ("/v1/embeddings", json!({"model": "m", "input": "hi"})),
    ];
    let bad_keys: [Option<&str>; 4] = [
        None,
        Some("nope"),
        Some("sk-strata-0011223344556677-00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"),
        // The right id with a wrong secret.
        Some(&good[..good.len() - 1]),
    ];
    for (path, body) in &bodies {
        for k in bad_keys {
            let (status, _, resp) = post(&format!("{url}{path}"), k, body).await;
            assert_eq!(status, 401, "{path} {k:?}");
            assert_eq!(assert_openai_error(&resp)["type"], "authentication_error");
        }
    }
    let resp = client()
        .get(format!("{url}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    // x-api-key works too, and /v1/models lists the model.
    let resp = client()
        .get(format!("{url}/v1/models"))
        .header("x-api-key", &good)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["data"][0]["id"], "m");
    assert_eq!(m.requests(), 0, "nothing reached the upstream");
    gw.shutdown().await;
}

#[tokio::test]
async fn revoked_key_stops_at_once() {
    let OneModel {
        mock: m,
        gw,
        chat: url,
    } = one_model("", "").await;
    let (k, rec) = gw
        .gateway
        .create_key(CreateKey {
            tenant: "t".into(),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(post(&url, Some(&k), &chat_body("m")).await.0, 200);
    let resp = client()
        .delete(format!("{}/admin/keys/{}", gw.url(), rec.id))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let (status, _, body) = post(&url, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(m.requests(), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn bad_requests_get_openai_errors_without_reaching_upstream() {
    let OneModel {
        mock: m,
        gw,
        chat: url,
    } = one_model("", "server: {max_body_bytes: 2048}").await;
    let k = key(&gw, "t");
    let send_raw = |body: Vec<u8>| {
        let k = k.clone();
        let url = url.clone();
        async move {
            let resp = client()
                .post(&url)
                .bearer_auth(&k)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let s = resp.status().as_u16();
            (s, resp.json::<serde_json::Value>().await.unwrap())
        }
    };
    let cases: Vec<(Vec<u8>, u16, Option<&str>)> = vec![
        (b"{not json".to_vec(), 400, None),
        (b"".to_vec(), 400, None),
        (b"[1,2]".to_vec(), 400, None),
        (br#"{"model":"m"}"#.to_vec(), 400, Some("messages")),
        (
            br#"{"model":"m","messages":[]}"#.to_vec(),
            400,
            Some("messages"),
        ),
        (
            br#"{"model":"m","messages":"hi"}"#.to_vec(),
            400,
            Some("messages"),
        ),
        (
            br#"{"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
            400,
            Some("model"),
        ),
        (
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}"#.to_vec(),
            400,
            Some("max_tokens"),
        ),
        (
            br#"{"model":"ghost","messages":[{"role":"user","content":"x"}]}"#.to_vec(),
            404,
            Some("model"),
        ),
        (
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
                "x".repeat(4096)
            )
            .into_bytes(),
            413,
            None,
        ),
    ];
    for (body, want, param) in cases {
        let shown = String::from_utf8_lossy(&body[..body.len().min(60)]).into_owned();
        let (status, resp) = send_raw(body).await;
        assert_eq!(status, want, "{shown}: {resp}");
        let e = assert_openai_error(&resp);
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{shown}: {resp}");
        }
    }
    // Wrong method: OpenAI-shaped 405.
    let resp = client().get(&url).bearer_auth(&k).send().await.unwrap();
    assert_eq!(resp.status(), 405);
    assert_openai_error(&resp.json().await.unwrap());
    // Unknown route: OpenAI-shaped 404.
    let (status, _, resp) = post(&format!("{}/v1/nothing", gw.url()), Some(&k), &json!({})).await;
    assert_eq!(status, 404);
    assert_openai_error(&resp);
    assert_eq!(m.requests(), 0);
    gw.shutdown().await;
}

#[tokio::test]
async fn per_key_model_allow_list_is_enforced() {
    let OneModel {
        mock: m,
        gw,
        chat: url,
    } = one_model(
        "  - name: other\n    targets: [{upstream: up, model: m}]",
        "",
    )
    .await;
    let k = key_with(
        &gw,
        CreateKey {
            tenant: "t".into(),
            allowed_models: vec!["other".into()],
            ..Default::default()
        },
    );
    let (status, _, body) = post(&url, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(assert_openai_error(&body)["code"], "model_not_allowed");
    assert_eq!(post(&url, Some(&k), &chat_body("other")).await.0, 200);
    assert_eq!(m.requests(), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn falls_back_on_5xx_and_on_hang_timeout() {
    let bad = mock("m").await;
    let hang = mock("m").await;
    let good = mock("m").await;
    bad.set_fault(Fault::Status(503));
    hang.set_fault(Fault::Hang);
    let yaml = format!(
        r#"
upstreams:
  - {{name: bad, base_url: "{}"}}
  - {{name: hang, base_url: "{}"}}
  - {{name: good, base_url: "{}"}}
models:
  - name: primary
    targets: [{{upstream: bad, model: m}}]
    fallbacks: [slow, backup]
    retries: 1
    backoff_ms: 1
  - name: slow
    targets: [{{upstream: hang, model: m}}]
    try_timeout_ms: 300
    retries: 0
  - name: backup
    targets: [{{upstream: good, model: m}}]
"#,
        bad.url(),
        hang.url(),
        good.url()
    );
    let gw = gateway(&yaml).await;
    let k = key(&gw, "t");
    let (status, headers, body) = post(
        &format!("{}/v1/chat/completions", gw.url()),
        Some(&k),
        &chat_body("primary"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["x-strata-upstream"], "good");
    assert_eq!(headers["x-strata-model"], "backup");
    assert_eq!(bad.requests(), 2, "one try and one retry");
    assert_eq!(hang.requests(), 1, "cut by the per-try timeout");
    assert_eq!(good.requests(), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn connect_errors_and_total_timeout_give_503() {
    let dead = mock("m").await;
    let url = dead.url();
    dead.shutdown().await;
    let gw = gateway(&format!(
        "upstreams:\n  - {{name: dead, base_url: \"{url}\"}}\nmodels:\n  - name: m\n    targets: [{{upstream: dead}}]\n    retries: 2\n    backoff_ms: 1\n"
    ))
    .await;
    let k = key(&gw, "t");
    let (status, _, body) = post(
        &format!("{}/v1/chat/completions", gw.url()),
        Some(&k),
        &chat_body("m"),
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        assert_openai_error(&body)["type"],
        "service_unavailable_error"
    );
    gw.shutdown().await;

    let hang = mock("m").await;
    hang.set_fault(Fault::Hang);
    let gw = gateway(&format!(
        "upstreams:\n  - {{name: h, base_url: \"{}\"}}\nmodels:\n  - name: m\n    targets: [{{upstream: h}}]\n    timeout_ms: 300\n    retries: 5\n    backoff_ms: 1\n",
        hang.url()
    ))
    .await;
    let k = key(&gw, "t");
    let started = std::time::Instant::now();
    let (status, _, body) = post(
        &format!("{}/v1/chat/completions", gw.url()),
        Some(&k),
        &chat_body("m"),
    )
    .await;
    assert_eq!(status, 503, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the total timeout cut it"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn context_length_skips_to_a_larger_model() {
    let small = mock("s").await;
    let big = mock("b").await;
    let yaml = format!(
        r#"
upstreams:
  - {{name: small, base_url: "{}"}}
  - {{name: big, base_url: "{}"}}
models:
  - name: m
    targets: [{{upstream: small, model: s}}]
    context_length: 20
    fallbacks: [m-large]
  - name: m-large
    targets: [{{upstream: big, model: b}}]
    context_length: 100000
"#,
        small.url(),
        big.url()
    );
    let gw = gateway(&yaml).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    let mut body = chat_body("m");
    body["max_tokens"] = json!(100);
    let (status, headers, resp) = post(&url, Some(&k), &body).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(headers["x-strata-model"], "m-large");
    assert_eq!(small.requests(), 0);
    // Too large for every model: 400 without any call.
    body["max_tokens"] = json!(200_000);
    let (status, _, resp) = post(&url, Some(&k), &body).await;
    assert_eq!(status, 400, "{resp}");
    assert_eq!(
        assert_openai_error(&resp)["code"],
        "context_length_exceeded"
    );
    assert_eq!(big.requests(), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn weighted_split_sends_traffic_to_both_targets() {
    let a = mock("m").await;
    let b = mock("m").await;
    let yaml = format!(
        "upstreams:\n  - {{name: a, base_url: \"{}\"}}\n  - {{name: b, base_url: \"{}\"}}\nmodels:\n  - name: m\n    targets: [{{upstream: a, weight: 3}}, {{upstream: b, weight: 1}}]\n",
        a.url(),
        b.url()
    );
    let gw = gateway(&yaml).await;
    let k = key(&gw, "t");
    let url = format!("{}/v1/chat/completions", gw.url());
    for _ in 0..80 {
        assert_eq!(post(&url, Some(&k), &chat_body("m")).await.0, 200);
    }
    let (na, nb) = (a.requests(), b.requests());
    assert_eq!(na + nb, 80);
    assert!(na > nb && nb > 0, "a={na} b={nb}");
    gw.shutdown().await;
}

#[tokio::test]
async fn streaming_passes_chunks_and_accounts_usage() {
    let OneModel {
        mock: _m,
        gw,
        chat: url,
    } = one_model("    price: {input_per_1m: 0, output_per_1m: 1000000}", "").await;
    let k = key(&gw, "t");
    let mut body = chat_body("m");
    body["stream"] = json!(true);
    let resp = client()
        .post(&url)
        .bearer_auth(&k)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let text = resp.text().await.unwrap();
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(text.matches("data: ").count() >= 9, "{text}");
    // Usage reaches the ledger when the stream ends (settled in the background).
    let mut cost = serde_json::Value::Null;
    for _ in 0..100 {
        let (_, usage) = admin_get(&gw, "/admin/usage").await;
        cost = usage["total_cost_micros"].clone();
        if cost == 8_000_000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cost, 8_000_000, "8 output tokens at $1 each");
    gw.shutdown().await;
}

#[tokio::test]
async fn request_rate_limit_gives_429_with_headers() {
    let OneModel {
        mock: m,
        gw,
        chat: url,
    } = one_model("", "limits: {default_key: {rpm: 3}}").await;
    let k = key(&gw, "t");
    for i in 0..3 {
        let (status, headers, _) = post(&url, Some(&k), &chat_body("m")).await;
        assert_eq!(status, 200);
        assert_eq!(headers["x-ratelimit-limit-requests"], "3");
        assert_eq!(
            headers["x-ratelimit-remaining-requests"],
            (2 - i).to_string().as_str()
        );
    }
    let (status, headers, body) = post(&url, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(assert_openai_error(&body)["code"], "rate_limit_exceeded");
    let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=20).contains(&retry), "{retry}");
    assert_eq!(headers["x-ratelimit-remaining-requests"], "0");
    assert_eq!(m.requests(), 3);
    // Another key of another tenant is not affected.
    let other = key(&gw, "u");
    assert_eq!(post(&url, Some(&other), &chat_body("m")).await.0, 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn token_limit_reconciles_estimate_with_real_usage() {
    // Estimate per request: 3 prompt tokens (11 chars / 4) + 100 max_tokens = 103.
    // Real usage: 2 + 8 = 10, so after reconcile many more requests fit.
    let OneModel {
        mock: _m,
        gw,
        chat: url,
    } = one_model("", "tenants:\n  - {name: t, limits: {tpm: 250}}").await;
    let k = key(&gw, "t");
    let mut body = chat_body("m");
    body["max_tokens"] = json!(100);
    for i in 0..10 {
        let (status, _, resp) = post(&url, Some(&k), &body).await;
        assert_eq!(status, 200, "request {i}: {resp}");
    }
    // Without reconcile only 2 would have fitted in 250.
    body["max_tokens"] = json!(300);
    let (status, headers, resp) = post(&url, Some(&k), &body).await;
    assert_eq!(status, 429, "{resp}");
    assert!(resp["error"]["message"]
        .as_str()
        .unwrap()
        .contains("too large"));
    assert!(headers.get("retry-after").is_none());
    gw.shutdown().await;
}

#[tokio::test]
async fn spent_budget_gets_429_with_a_clear_message() {
    let OneModel {
        mock: m,
        gw,
        chat: url,
    } = one_model(
        "    price: {input_per_1m: 100000, output_per_1m: 100000}",
        "",
    )
    .await;
    // Each request costs (2 + 8) tokens x $0.1 = $1; budget $1.5.
    let k = key_with(
        &gw,
        CreateKey {
            tenant: "t".into(),
            budget_usd: Some(1.5),
            ..Default::default()
        },
    );
    assert_eq!(post(&url, Some(&k), &chat_body("m")).await.0, 200);
    assert_eq!(post(&url, Some(&k), &chat_body("m")).await.0, 200);
    let (status, _, body) = post(&url, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 429, "{body}");
    let e = assert_openai_error(&body);
    assert_eq!(e["code"], "budget_exceeded");
    assert!(e["message"].as_str().unwrap().contains("Budget exceeded"));
    assert_eq!(m.requests(), 2);
    // A tenant budget set through the admin API applies to every key of the tenant.
    let k2 = key(&gw, "u");
    let resp = client()
        .put(format!("{}/admin/tenants/u", gw.url()))
        .bearer_auth(ADMIN)
        .json(&json!({"budget_usd": 0.5}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(post(&url, Some(&k2), &chat_body("m")).await.0, 200);
    let (status, _, body) = post(&url, Some(&k2), &chat_body("m")).await;
    assert_eq!(status, 429, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("tenant `u`"));
    gw.shutdown().await;
}

#[tokio::test]
async fn cache_hits_are_per_tenant_and_respect_no_cache() {
    let OneModel {
        mock: m,
        gw,
        chat: url,
    } = one_model("", "cache: {enabled: true, ttl_secs: 60}").await;
    let a = key(&gw, "tenant-a");
    let a2 = key(&gw, "tenant-a");
    let b = key(&gw, "tenant-b");
    let mut body = chat_body("m");
    body["temperature"] = json!(0);
    let (s, h, first) = post(&url, Some(&a), &body).await;
    assert_eq!((s, h["x-strata-cache"].to_str().unwrap()), (200, "miss"));
    let (s, h, again) = post(&url, Some(&a2), &body).await;
    assert_eq!((s, h["x-strata-cache"].to_str().unwrap()), (200, "hit"));
    assert_eq!(first["id"], again["id"], "the same stored answer");
    assert_eq!(m.requests(), 1);
    // Tenant B never receives A's entry.
    let (s, h, theirs) = post(&url, Some(&b), &body).await;
    assert_eq!((s, h["x-strata-cache"].to_str().unwrap()), (200, "miss"));
    assert_ne!(theirs["id"], first["id"]);
    assert_eq!(m.requests(), 2);
    // no-cache bypasses the lookup.
    let resp = client()
        .post(&url)
        .bearer_auth(&a)
        .header("cache-control", "no-cache")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-strata-cache"], "miss");
    assert_eq!(m.requests(), 3);
    // Non-deterministic requests are not cached.
    let mut hot = chat_body("m");
    hot["temperature"] = json!(0.8);
    post(&url, Some(&a), &hot).await;
    let (_, h, _) = post(&url, Some(&a), &hot).await;
    assert!(h.get("x-strata-cache").is_none());
    assert_eq!(m.requests(), 5);
    gw.shutdown().await;
}

#[tokio::test]
async fn guardrails_block_input_and_redact_output() {
    let extra = r#"
guardrails:
  max_prompt_chars: 200
  patterns:
    - {kind: private_key, action: block}
    - {kind: email, action: redact}
    - {kind: custom, regex: "tok", action: redact, input: false}
"#;
    let OneModel {
        mock: m,
        gw,
        chat: url,
    } = one_model("", extra).await;
    let k = key(&gw, "t");
    let mut body = chat_body("m");
    body["messages"][0]["content"] =
        json!("here: -----BEGIN PRIVATE KEY-----\nabc\n-----END PRIVATE KEY-----");
    let (status, _, resp) = post(&url, Some(&k), &body).await;
    assert_eq!(status, 400, "{resp}");
    assert_eq!(assert_openai_error(&resp)["code"], "guardrail_blocked");
    body["messages"][0]["content"] = json!("x".repeat(201));
    let (status, _, resp) = post(&url, Some(&k), &body).await;
    assert_eq!(status, 400, "{resp}");
    assert_eq!(resp["error"]["code"], "prompt_too_large");
    assert_eq!(m.requests(), 0, "blocked prompts never reach the model");
    let (status, _, resp) = post(&url, Some(&k), &chat_body("m")).await;
    assert_eq!(status, 200);
    let content = resp["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        content.contains("[REDACTED:custom]") && !content.contains("tok"),
        "{content}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn admin_api_requires_the_admin_key_and_audits() {
    let OneModel { mock: _m, gw, .. } = one_model("", "").await;
    let url = gw.url();
    let k = key(&gw, "t");
    for bad in [None, Some("wrong")] {
        let mut rb = client().get(format!("{url}/admin/keys"));
        if let Some(b) = bad {
            rb = rb.bearer_auth(b);
        }
        let resp = rb.send().await.unwrap();
        assert_eq!(resp.status(), 401);
    }
    // A member key is a known caller without an admin role: 403.
    let resp = client()
        .get(format!("{url}/admin/keys"))
        .bearer_auth(&k)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let resp = client()
        .post(format!("{url}/admin/keys"))
        .bearer_auth(ADMIN)
        .json(&json!({"tenant": "z", "rpm": 5, "allowed_models": ["m"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let created: serde_json::Value = resp.json().await.unwrap();
    let full = created["key"].as_str().unwrap();
    assert!(full.starts_with("sk-strata-"));
    assert!(created.get("hash_hex").is_none() && created.get("salt_hex").is_none());
    let (_, list) = admin_get(&gw, "/admin/keys").await;
    let listed = list.to_string();
    assert_eq!(list["data"].as_array().unwrap().len(), 2);
    assert!(!listed.contains(&full[20..]), "secrets are never listed");
    let resp = client()
        .post(format!("{url}/admin/keys"))
        .bearer_auth(ADMIN)
        .json(&json!({"tenant": "z", "allowed_models": ["ghost"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    let (_, audit) = admin_get(&gw, "/admin/audit").await;
    assert!(audit["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["action"] == "create_key"));
    assert!(
        !audit.to_string().contains(&full[20..]),
        "secrets are never audited"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn keys_cli_talks_to_the_admin_api() {
    use strata_gateway::{KeysArgs, KeysCommand};
    let OneModel {
        mock: _m,
        gw,
        chat: url,
    } = one_model("", "").await;
    let args = |command| KeysArgs {
        url: gw.url(),
        admin_key: Some(ADMIN.into()),
        command,
    };
    let created = strata_gateway::cli::keys_request(&args(KeysCommand::Create {
        tenant: "cli".into(),
        name: Some("n".into()),
        models: vec![],
        rpm: None,
        tpm: None,
        budget_usd: Some(5.0),
        budget_period: Some(strata_gateway::budget::Period::Daily),
        user: Some("ursula".into()),
        role: Some(strata_gateway::role::Role::TenantAdmin),
    }))
    .await
    .unwrap();
    assert_eq!(
        (
            created["budget_period"].as_str(),
            created["user"].as_str(),
            created["role"].as_str()
        ),
        (Some("daily"), Some("ursula"), Some("tenant_admin")),
        "{created}"
    );
    let key = created["key"].as_str().unwrap().to_string();
    let id = created["id"].as_str().unwrap().to_string();
    assert_eq!(post(&url, Some(&key), &chat_body("m")).await.0, 200);
    let list = strata_gateway::cli::keys_request(&args(KeysCommand::List))
        .await
        .unwrap();
    assert_eq!(list["data"][0]["id"], id.as_str());
    strata_gateway::cli::keys_request(&args(KeysCommand::Revoke { id }))
        .await
        .unwrap();
    assert_eq!(post(&url, Some(&key), &chat_body("m")).await.0, 401);
    let wrong = KeysArgs {
        url: gw.url(),
        admin_key: Some("bad".into()),
        command: KeysCommand::List,
    };
    assert!(strata_gateway::cli::keys_request(&wrong).await.is_err());
    gw.shutdown().await;
}

#[tokio::test]
async fn upstream_client_errors_are_relayed_without_fallback() {
    let a = mock("m").await;
    let b = mock("m").await;
    a.set_fault(Fault::Status(422));
    let yaml = format!(
        "upstreams:\n  - {{name: a, base_url: \"{}\"}}\n  - {{name: b, base_url: \"{}\"}}\nmodels:\n  - name: m\n    targets: [{{upstream: a}}]\n    fallbacks: [m2]\n  - name: m2\n    targets: [{{upstream: b, model: m}}]\n",
        a.url(),
        b.url()
    );
    let gw = gateway(&yaml).await;
    let k = key(&gw, "t");
    let (status, _, body) = post(
        &format!("{}/v1/chat/completions", gw.url()),
        Some(&k),
        &chat_body("m"),
    )
    .await;
    assert_eq!(status, 422, "{body}");
    assert!(assert_openai_error(&body)["message"]
        .as_str()
        .unwrap()
        .contains("injected failure"));
    assert_eq!(
        (a.requests(), b.requests()),
        (1, 0),
        "a client error is not retried elsewhere"
    );
    let text = metrics_text(&gw).await;
    assert!(
        text.contains("strata_gateway_requests_total{model=\"m\",status=\"422\"} 1"),
        "{text}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn upstream_cut_mid_stream_ends_the_client_stream_and_the_gateway_survives() {
    let OneModel {
        mock: m,
        gw,
        chat: url,
    } = one_model("", "tenants:\n  - {name: t, limits: {tpm: 100000}}").await;
    let k = key(&gw, "t");
    m.set_fault(Fault::CloseMidStream { after_chunks: 2 });
    let mut body = chat_body("m");
    body["stream"] = json!(true);
    let resp = client()
        .post(&url)
        .bearer_auth(&k)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // The body ends early (an error or a short stream), never with [DONE].
    if let Ok(text) = resp.text().await {
        assert!(!text.contains("[DONE]"), "{text}");
    }
    // A client that goes away mid-stream does not wedge anything either.
    m.set_fault(Fault::None);
    let slow = strata_mock::MockEngine::spawn(strata_mock::MockConfig {
        model: "m".into(),
        output_tokens: 1000,
        itl: Duration::from_millis(5),
        ..Default::default()
    })
    .await
    .unwrap();
    let gw2 = gateway(&yaml_one(&slow.url(), "m", "", "")).await;
    let k2 = key(&gw2, "t");
    let mut resp = client()
        .post(format!("{}/v1/chat/completions", gw2.url()))
        .bearer_auth(&k2)
        .json(
            &json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert!(resp.chunk().await.unwrap().is_some());
    drop(resp);
    let mut done = false;
    for _ in 0..200 {
        if slow.in_flight() == 0 {
            done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        done,
        "the upstream request was cancelled when the client left"
    );
    // Both gateways still serve.
    assert_eq!(post(&url, Some(&k), &chat_body("m")).await.0, 200);
    gw.shutdown().await;
    gw2.shutdown().await;
}
