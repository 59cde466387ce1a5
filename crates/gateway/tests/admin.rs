//! The admin API's shared preamble (admin key, then JSON body) answers every bad request
//! with an OpenAI-shaped error before any handler runs.

mod common;

use common::*;
use serde_json::Value;

#[tokio::test]
async fn admin_key_is_checked_before_the_body_and_bad_bodies_are_openai_errors() {
    let m = mock("m").await;
    let gw = gateway(&yaml_one(&m.url(), "m", "", "")).await;
    let url = gw.url();
    let send = |method: reqwest::Method, path: &str, key: Option<&str>, body: &str| {
        let mut rb = client()
            .request(method, format!("{url}{path}"))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(k) = key {
            rb = rb.bearer_auth(k);
        }
        async move {
            let resp = rb.send().await.unwrap();
            let status = resp.status().as_u16();
            let v: Value = resp.json().await.unwrap_or(Value::Null);
            (status, v)
        }
    };
    // No key: 401 even when the body is garbage (the key is checked first).
    let (status, body) = send(reqwest::Method::POST, "/admin/keys", None, "{nope").await;
    assert_eq!(status, 401);
    assert_eq!(assert_openai_error(&body)["code"], "invalid_api_key");
    let (status, body) = send(
        reqwest::Method::PUT,
        "/admin/tenants/t",
        Some("wrong"),
        "{}",
    )
    .await;
    assert_eq!(status, 401, "{body}");
    // Admin key, malformed JSON / wrong field types / unknown fields: 400, nothing created.
    for (method, path, bad) in [
        (reqwest::Method::POST, "/admin/keys", "{nope"),
        (reqwest::Method::POST, "/admin/keys", r#"{"tenant": 5}"#),
        (
            reqwest::Method::POST,
            "/admin/keys",
            r#"{"tenant": "t", "bogus": 1}"#,
        ),
        (
            reqwest::Method::PUT,
            "/admin/keys/abc",
            r#"{"rpm": "many"}"#,
        ),
        (reqwest::Method::PUT, "/admin/tenants/t", "[]"),
    ] {
        let (status, body) = send(method, path, Some(ADMIN), bad).await;
        assert_eq!(status, 400, "{path} {bad}: {body}");
        assert_openai_error(&body);
    }
    let (_, list) = admin_get(&gw, "/admin/keys").await;
    assert_eq!(list["data"].as_array().unwrap().len(), 0);
    // The same routes work with a good body.
    let (status, _) = send(
        reqwest::Method::PUT,
        "/admin/tenants/t",
        Some(ADMIN),
        r#"{"rpm": 5}"#,
    )
    .await;
    assert_eq!(status, 200);
    gw.shutdown().await;
}
