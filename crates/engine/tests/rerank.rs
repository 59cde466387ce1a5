//! `/score`, `/rerank`, `/v1/rerank` and `/v2/rerank` on the embedding model
//! (all-MiniLM-L6-v2), in process on a loopback port: scores are the cosine similarity of
//! `/v1/embeddings`' vectors, results are sorted by relevance and cut to `top_n`, usage is
//! counted as vLLM counts it, many documents run as one forward, and bad input gets vLLM's
//! 400s.

mod common;

use common::{post, request};

use std::net::SocketAddr;
use std::sync::Arc;

use serde_json::{json, Value};
use strata_engine::embed::server::EmbedState;
use strata_engine::server::EngineOptions;

const NAME: &str = "all-minilm-l6-v2";

fn start() -> (SocketAddr, Arc<EmbedState>) {
    common::serve_encoder(&EngineOptions {
        model_path: common::embedding_model_dir(),
        model_name: NAME.into(),
        max_body_bytes: 256 * 1024,
        ..EngineOptions::default()
    })
}

const QUERY: &str = "How do I keep my houseplants alive?";
const DOCS: [&str; 5] = [
    "The stock market fell sharply on Tuesday.",
    "Water your plants once a week and give them indirect sunlight.",
    "A guide to caring for indoor plants such as ferns and succulents.",
    "The recipe calls for two cups of flour and one egg.",
    "Overwatering is the most common reason potted plants die.",
];

/// `/v1/embeddings`' vectors and token counts of `texts`.
fn embed(addr: SocketAddr, texts: &[&str]) -> (Vec<Vec<f64>>, Vec<usize>) {
    let mut vectors = Vec::new();
    let mut lens = Vec::new();
    for t in texts {
        let (status, v) = post(addr, "/v1/embeddings", &json!({"input": t}));
        assert_eq!(status, 200, "{v}");
        vectors.push(serde_json::from_value(v["data"][0]["embedding"].clone()).unwrap());
        lens.push(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize);
    }
    (vectors, lens)
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

#[test]
fn scores_are_the_cosine_of_the_embeddings() {
    let (addr, state) = start();
    let (q, q_len) = embed(addr, &[QUERY]);
    let (docs, doc_lens) = embed(addr, &DOCS);
    let want: Vec<f64> = docs.iter().map(|d| cosine(&q[0], d)).collect();
    // vLLM counts both texts of a pair and the [PAD] between them.
    let tokens: usize = doc_lens.iter().map(|d| q_len[0] + 1 + d).sum();

    // 1:N, one forward for the query and every document.
    let before = state.worker.forwards();
    let (status, v) = post(
        addr,
        "/score",
        &json!({"model": NAME, "text_1": QUERY, "text_2": DOCS}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(state.worker.forwards() - before, 1, "one batch");
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], NAME);
    assert!(v["id"].as_str().unwrap().starts_with("score-"));
    assert!(v["created"].as_u64().unwrap() > 0);
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), DOCS.len());
    for (i, d) in data.iter().enumerate() {
        assert_eq!(d["index"], i);
        assert_eq!(d["object"], "score");
        let got = d["score"].as_f64().unwrap();
        assert!(
            (got - want[i]).abs() < 1e-5,
            "pair {i}: {got} vs {}",
            want[i]
        );
    }
    assert_eq!(v["usage"]["prompt_tokens"], tokens);
    assert_eq!(v["usage"]["total_tokens"], tokens);
    assert_eq!(v["usage"]["completion_tokens"], 0);

    // N:N pairs by position, under vLLM's other names too.
    let (status, v) = post(
        addr,
        "/v1/score",
        &json!({"queries": [QUERY, DOCS[0]], "documents": [DOCS[1], DOCS[3]]}),
    );
    assert_eq!(status, 200, "{v}");
    let n_n = [cosine(&q[0], &docs[1]), cosine(&docs[0], &docs[3])];
    for (d, w) in v["data"].as_array().unwrap().iter().zip(n_n) {
        assert!((d["score"].as_f64().unwrap() - w).abs() < 1e-5, "{v}");
    }
}

#[test]
fn rerank_sorts_by_relevance_on_three_paths() {
    let (addr, state) = start();
    let (q, q_len) = embed(addr, &[QUERY]);
    let (docs, doc_lens) = embed(addr, &DOCS);
    let want: Vec<f64> = docs.iter().map(|d| cosine(&q[0], d)).collect();
    let mut order: Vec<usize> = (0..DOCS.len()).collect();
    order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
    let tokens: usize = doc_lens.iter().map(|d| q_len[0] + 1 + d).sum();
    // The plant documents first, the stock market and the recipe last.
    assert!(
        order[..3].iter().all(|i| [1, 2, 4].contains(i)),
        "{order:?}"
    );

    let body = json!({"model": NAME, "query": QUERY, "documents": DOCS});
    let mut answers = Vec::new();
    for path in ["/rerank", "/v1/rerank", "/v2/rerank"] {
        let before = state.worker.forwards();
        let (status, v) = post(addr, path, &body);
        assert_eq!(status, 200, "{path}: {v}");
        assert_eq!(state.worker.forwards() - before, 1, "{path}: one batch");
        assert!(v["id"].as_str().unwrap().starts_with("rerank-"));
        assert_eq!(v["model"], NAME);
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": tokens, "total_tokens": tokens})
        );
        let results = v["results"].as_array().unwrap();
        assert_eq!(results.len(), DOCS.len());
        for (r, &i) in results.iter().zip(&order) {
            assert_eq!(r["index"], i, "{path}: {v}");
            assert_eq!(r["document"]["text"], DOCS[i]);
            assert!((r["relevance_score"].as_f64().unwrap() - want[i]).abs() < 1e-5);
        }
        answers.push(results.clone());
    }
    assert!(
        answers.windows(2).all(|w| w[0] == w[1]),
        "the three paths agree"
    );

    // top_n cuts the sorted list; return_documents: false leaves the text out.
    let (status, v) = post(
        addr,
        "/v2/rerank",
        &json!({"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": false}),
    );
    assert_eq!(status, 200, "{v}");
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0]["index"], order[0]);
    assert_eq!(results[1]["index"], order[1]);
    assert!(results[0].get("document").is_none(), "{v}");
    // Usage counts every document scored, not only those returned.
    assert_eq!(v["usage"]["prompt_tokens"], tokens);
    // No top_n, and a top_n past the end, return every document.
    for body in [
        json!({"query": QUERY, "documents": DOCS}),
        json!({"query": QUERY, "documents": DOCS, "top_n": 99}),
    ] {
        let (status, v) = post(addr, "/rerank", &body);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["results"].as_array().unwrap().len(), DOCS.len(), "{body}");
    }
}

#[test]
fn many_documents_run_as_one_forward() {
    let (addr, state) = start();
    let docs: Vec<String> = (0..64)
        .map(|i| format!("Document number {i} about plants, water and light."))
        .collect();
    let before = state.worker.forwards();
    let (status, v) = post(
        addr,
        "/rerank",
        &json!({"query": QUERY, "documents": docs, "top_n": 3}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(state.worker.forwards() - before, 1);
    assert_eq!(v["results"].as_array().unwrap().len(), 3);
}

#[test]
fn bad_input_gets_vllm_s_400s() {
    let (addr, _) = start();
    let long = "word ".repeat(300);
    let cases: Vec<(&str, Value, &str, &str)> = vec![
        (
            "/rerank",
            json!({"query": QUERY, "documents": []}),
            "documents",
            "At least one text_pair element must be given",
        ),
        (
            "/rerank",
            json!({"query": QUERY, "documents": ["short", long]}),
            "documents[1]",
            "However, the model's context length is only 256 tokens, resulting in a maximum \
             input length of 256 tokens. Please reduce the length of the input prompt.",
        ),
        (
            "/score",
            json!({"text_1": long, "text_2": "short"}),
            "text_1",
            "You passed 302 input tokens",
        ),
        (
            "/score",
            json!({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
            "text_1",
            "Input lengths must be either 1:1, 1:N or N:N",
        ),
        (
            "/score",
            json!({"text_1": [], "text_2": ["c"]}),
            "text_1",
            "At least one text element must be given",
        ),
        (
            "/rerank",
            json!({"documents": ["a"]}),
            "query",
            "query is required",
        ),
        (
            "/rerank",
            json!({"query": QUERY, "documents": ["a"], "truncate_prompt_tokens": 0}),
            "truncate_prompt_tokens",
            "-1 or a positive integer",
        ),
        (
            "/rerank",
            json!({"query": "", "documents": ["a"]}),
            "query",
            "query must not be empty",
        ),
        (
            "/v1/rerank",
            json!({"query": QUERY, "documents": ["a"], "top_n": 0}),
            "top_n",
            "top_n must be a positive integer, got 0",
        ),
        (
            "/v2/rerank",
            json!({"query": QUERY, "documents": ["a"], "top_n": -1}),
            "top_n",
            "top_n must be a positive integer, got -1",
        ),
        (
            "/classify",
            json!({"input": "a"}),
            "model",
            "is an embedding model and does not support /classify",
        ),
    ];
    for (path, body, param, text) in cases {
        let (status, v) = post(addr, path, &body);
        assert_eq!(status, 400, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(text),
            "{v}"
        );
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    // A model this engine does not serve: OpenAI's 404 shape.
    for path in ["/rerank", "/score"] {
        let body = if path == "/score" {
            json!({"model": "other", "text_1": "a", "text_2": ["b"]})
        } else {
            json!({"model": "other", "query": "a", "documents": ["b"]})
        };
        let (status, v) = post(addr, path, &body);
        assert_eq!(status, 404, "{path}: {v}");
        assert_eq!(v["error"]["param"], "model", "{v}");
        assert_eq!(v["error"]["code"], "model_not_found", "{v}");
        assert_eq!(
            v["error"]["message"], "The model `other` does not exist.",
            "{v}"
        );
    }
    // A body that is not JSON, or not the right JSON: a 400 naming no library internals.
    for (path, raw) in [
        ("/rerank", "{\"query\": \"a\", \"documents\": [\"b\""),
        ("/score", "not json"),
        (
            "/v2/rerank",
            "{\"query\": \"a\", \"documents\": [\"b\"], \"top_n\": \"two\"}",
        ),
    ] {
        let (status, text) = request(addr, "POST", path, raw.as_bytes());
        assert_eq!(status, 400, "{path} {raw}: {text}");
        let v: Value = serde_json::from_str(&text).expect("an error body in JSON");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(!message.is_empty() && !message.contains("serde"), "{v}");
    }
    // A long document is cut when asked, and then scored.
    let (status, v) = post(
        addr,
        "/rerank",
        &json!({"query": QUERY, "documents": [long], "truncate_prompt_tokens": -1}),
    );
    assert_eq!(status, 200, "{v}");
}
