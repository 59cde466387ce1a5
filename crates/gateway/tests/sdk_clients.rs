//! The official SDKs against the gateway over a Strata engine (the default 135M model,
//! in process, tool calls parsed as Hermes): Anthropic's Python SDK on `/v1/messages`
//! (create, stream, a tool-use round trip whole and streamed, count_tokens, errors) and
//! OpenAI's on `/v1/responses` (create, stream, previous_response_id, retrieve, function
//! tools, a JSON schema, errors). The scripts are `tests/anthropic_client.py` and
//! `tests/openai_responses.py` (packages in `tests/requirements.txt`).

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::*;
use strata_engine::options::ToolOptions;
use strata_engine::server::EngineOptions;
use strata_engine::tools::ToolParser;

const MODEL: &str = "smollm2-135m-instruct";

/// The default model (`$STRATA_TEST_MODEL`, else `strata model pull`'s cache entry). A
/// missing model fails the test with what to run; it is never skipped.
fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_TEST_MODEL") {
        return PathBuf::from(p);
    }
    let cache = strata_engine::model_cache::ModelCache::from_env();
    let path = cache.path_of(strata_engine::model_cache::DEFAULT_MODEL);
    assert!(
        path.is_file(),
        "the default model is missing at {}; run `cargo run -p strata-cli -- model pull`",
        path.display()
    );
    path
}

/// A Strata engine on a loopback port, on a runtime thread of its own.
fn engine() -> String {
    let opts = EngineOptions {
        model_path: model_path(),
        model_name: MODEL.into(),
        tools: ToolOptions {
            auto_tool_choice: true,
            parser: Some(ToolParser::Hermes),
            chat_template: None,
            reasoning_parser: None,
        },
        ..Default::default()
    };
    let loaded = strata_engine::server::load(&opts).expect("load the model");
    let app = strata_engine::server::router(loaded.state.clone());
    let state = loaded.state;
    let addr = strata_mock::serve_on_thread(app, state).expect("engine address");
    format!("http://{addr}")
}

fn run_script(script: &str, args: &[&str]) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests")
        .join(script);
    let out = Command::new("python3")
        .arg(&path)
        .args(args)
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdks_speak_messages_and_responses_through_the_gateway() {
    let url = tokio::task::spawn_blocking(engine).await.unwrap();
    let gw = gateway(&format!(
        "upstreams:\n  - name: strata\n    base_url: {url}\nmodels:\n  - name: {MODEL}\n    targets: [{{upstream: strata}}]\n"
    ))
    .await;
    let k = key(&gw, "acme");
    let base = gw.url();
    let (b, kk) = (base.clone(), k.clone());
    tokio::task::spawn_blocking(move || run_script("anthropic_client.py", &[&b, &kk, MODEL]))
        .await
        .unwrap();
    let v1 = format!("{base}/v1");
    tokio::task::spawn_blocking(move || run_script("openai_responses.py", &[&v1, &k, MODEL]))
        .await
        .unwrap();
}
