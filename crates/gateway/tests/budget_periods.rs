//! Budget periods end to end with an injected clock: a daily tenant budget, a weekly user
//! budget and a daily key budget are spent, refused with 429 `budget_exceeded`, shown by
//! the admin API with the period's spend, and whole again once the clock passes the UTC
//! boundary; the period's spend survives a restart on the same store.

mod common;

use std::sync::Arc;

use common::*;
use serde_json::{json, Value};
use strata_gateway::clock::{Clock, ManualClock};
use strata_gateway::store::sqlite::SqliteStore;

/// 2026-12-03 (a Thursday) 12:00 UTC.
const NOON: i64 = 1_796_299_200;
const DAY: i64 = 86_400;

fn yaml(mock_url: &str) -> String {
    // Every request: 8 output tokens at $1 each = $8 (the mock answers 8 tokens).
    yaml_one(
        mock_url,
        "m",
        "    price: {input_per_1m: 0, output_per_1m: 1000000}",
        "tenants:\n  - {name: daily, budget_usd: 20, budget_period: daily}\n  - {name: people, user_budget_usd: 10, user_budget_period: weekly}\n  - {name: keys}",
    )
}

async fn chat(gw: &strata_gateway::RunningGateway, key: &str) -> (u16, Value) {
    let (s, _, body) = post(
        &format!("{}/v1/chat/completions", gw.url()),
        Some(key),
        &chat_body("m"),
    )
    .await;
    (s, body)
}

fn budget_refusal(status: u16, body: &Value, who: &str, period: &str) {
    assert_eq!(status, 429, "{body}");
    let e = assert_openai_error(body);
    assert_eq!(e["code"], "budget_exceeded");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains(who) && msg.contains(period), "{msg}");
}

async fn tenant_view(gw: &strata_gateway::RunningGateway, name: &str) -> Value {
    let (_, list) = admin_get(gw, "/admin/tenants").await;
    list["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .cloned()
        .unwrap_or(Value::Null)
}

#[tokio::test]
async fn budget_periods_roll_over_on_the_injected_clock_and_show_in_the_admin_api() {
    let m = mock("m").await;
    let clock = Arc::new(ManualClock::new(NOON));
    let store = Arc::new(SqliteStore::in_memory().unwrap());
    let gw = gateway_with_clock(
        &yaml(&m.url()),
        Some(store.clone()),
        Some(clock.clone() as Arc<dyn Clock>),
    )
    .await;

    // Daily tenant budget of $20: $8, $16, $24 spent, then refused until midnight UTC.
    let k = key(&gw, "daily");
    for _ in 0..3 {
        assert_eq!(chat(&gw, &k).await.0, 200);
    }
    let (s, body) = chat(&gw, &k).await;
    budget_refusal(s, &body, "tenant `daily`", "daily");
    let t = tenant_view(&gw, "daily").await;
    assert_eq!(t["budget_period"], "daily", "{t}");
    assert_eq!(t["period_spend_micros"], 24_000_000, "{t}");
    assert_eq!(t["period_start"], NOON - 12 * 3600, "{t}");
    assert_eq!(t["period_end"], NOON + 12 * 3600, "{t}");
    // One second before midnight: still spent. At midnight: a new period.
    clock.set(NOON + 12 * 3600 - 1);
    assert_eq!(chat(&gw, &k).await.0, 429);
    clock.set(NOON + 12 * 3600);
    let (s, body) = chat(&gw, &k).await;
    assert_eq!(s, 200, "{body}");
    let t = tenant_view(&gw, "daily").await;
    assert_eq!(t["period_spend_micros"], 8_000_000, "{t}");
    assert_eq!(t["spend_micros"], 32_000_000, "lifetime spend goes on: {t}");

    // A weekly user budget ($10 from the tenant's config): a key of user alice spends it.
    let (s, created) = send_admin(
        &gw,
        reqwest::Method::POST,
        "/admin/keys",
        json!({"tenant": "people", "user": "alice"}),
    )
    .await;
    assert_eq!(s, 201, "{created}");
    let alice = created["key"].as_str().unwrap().to_string();
    assert_eq!(chat(&gw, &alice).await.0, 200);
    assert_eq!(chat(&gw, &alice).await.0, 200);
    let (s, body) = chat(&gw, &alice).await;
    budget_refusal(s, &body, "user `alice` of tenant `people`", "weekly");
    // Another user of the same tenant has a budget of their own.
    let (_, created) = send_admin(
        &gw,
        reqwest::Method::POST,
        "/admin/keys",
        json!({"tenant": "people", "user": "bob"}),
    )
    .await;
    let bob = created["key"].as_str().unwrap().to_string();
    assert_eq!(chat(&gw, &bob).await.0, 200);
    // A stored user budget replaces the config's: alice gets $100 a day.
    let (s, _) = send_admin(
        &gw,
        reqwest::Method::PUT,
        "/admin/tenants/people/users/alice",
        json!({"budget_usd": 100, "budget_period": "daily"}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(chat(&gw, &alice).await.0, 200);
    let (_, users) = admin_get(&gw, "/admin/tenants/people/users").await;
    let a = users["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "alice")
        .unwrap()
        .clone();
    assert_eq!(
        (a["budget_period"].as_str(), a["budget_micros"].as_i64()),
        (Some("daily"), Some(100_000_000)),
        "{a}"
    );
    assert_eq!(a["period_spend_micros"], 24_000_000, "{a}");
    // Back to the weekly config budget; it resets on Monday 00:00 UTC.
    let (s, _) = send_admin(
        &gw,
        reqwest::Method::PUT,
        "/admin/tenants/people/users/alice",
        json!({}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(chat(&gw, &alice).await.0, 429);
    let monday = NOON - 12 * 3600 + 4 * DAY; // Thursday 00:00 + 4 days
    clock.set(monday - 1);
    assert_eq!(chat(&gw, &alice).await.0, 429);
    clock.set(monday);
    assert_eq!(chat(&gw, &alice).await.0, 200);

    // A daily key budget set through the admin API.
    let (s, created) = send_admin(
        &gw,
        reqwest::Method::POST,
        "/admin/keys",
        json!({"tenant": "keys", "budget_usd": 8, "budget_period": "daily"}),
    )
    .await;
    assert_eq!(s, 201, "{created}");
    let capped = created["key"].as_str().unwrap().to_string();
    let id = created["id"].as_str().unwrap().to_string();
    assert_eq!(chat(&gw, &capped).await.0, 200);
    let (s, body) = chat(&gw, &capped).await;
    budget_refusal(s, &body, &format!("API key {id}"), "daily");
    let (_, keys) = admin_get(&gw, "/admin/keys").await;
    let k = keys["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["id"] == id.as_str())
        .unwrap()
        .clone();
    assert_eq!(
        (
            k["budget_period"].as_str(),
            k["period_spend_micros"].as_i64()
        ),
        (Some("daily"), Some(8_000_000)),
        "{k}"
    );
    // A period needs a budget; an unknown period is a 400 naming the field.
    let (s, body) = send_admin(
        &gw,
        reqwest::Method::PUT,
        &format!("/admin/keys/{id}"),
        json!({"budget_period": "daily"}),
    )
    .await;
    assert_eq!(
        (s, body["error"]["param"].as_str()),
        (400, Some("budget_period")),
        "{body}"
    );
    let (s, body) = send_admin(
        &gw,
        reqwest::Method::PUT,
        &format!("/admin/keys/{id}"),
        json!({"budget_usd": 1, "budget_period": "hourly"}),
    )
    .await;
    assert_eq!(s, 400, "{body}");
    assert_openai_error(&body);

    // A restart on the same store keeps today's spend: the key is still refused today.
    gw.shutdown().await;
    let again = gateway_with_clock(
        &yaml(&m.url()),
        Some(store),
        Some(clock.clone() as Arc<dyn Clock>),
    )
    .await;
    let (s, body) = chat(&again, &capped).await;
    budget_refusal(s, &body, &format!("API key {id}"), "daily");
    clock.advance(DAY);
    assert_eq!(chat(&again, &capped).await.0, 200);
    again.shutdown().await;
}

async fn send_admin(
    gw: &strata_gateway::RunningGateway,
    method: reqwest::Method,
    path: &str,
    body: Value,
) -> (u16, Value) {
    let resp = client()
        .request(method, format!("{}{path}", gw.url()))
        .bearer_auth(ADMIN)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}
