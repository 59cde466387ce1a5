//! GGUF files the test writes itself: a tiny random llama in every supported tensor type
//! runs and agrees with its own f32 dequantization, and broken or unsupported files are
//! clear errors, never panics.

use std::path::PathBuf;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use strata_engine::gguf::{ModelError, SUPPORTED_TENSOR_TYPES};
use strata_engine::kv::cache::KvCache;
use strata_engine::model::{Llama, SeqInput, WeightFormat};

const HIDDEN: usize = 256;
const FFN: usize = 512;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const VOCAB: usize = 96;
const LAYERS: usize = 2;

fn temp_file(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("strata-gguf-{name}-{}.gguf", std::process::id()))
}

fn random(shape: &[usize], seed: u64) -> Tensor {
    // A deterministic pseudo-random fill (xorshift), scaled like trained weights.
    let n: usize = shape.iter().product();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<f32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).expect("tensor")
}

struct Spec {
    arch: &'static str,
    dtype: GgmlDType,
    skip_tensor: Option<&'static str>,
}

fn write_model(path: &PathBuf, spec: &Spec) {
    let kv = KV_HEADS * HIDDEN / HEADS;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut seed = 1;
    let mut add = |name: String, shape: &[usize], dtype: GgmlDType| {
        seed += 1;
        let mut t = random(shape, seed);
        if shape.len() == 1 {
            t = (t + 1.0).expect("norm weights near 1");
        }
        tensors.push((name, QTensor::quantize(&t, dtype).expect("quantize")));
    };
    add("token_embd.weight".into(), &[VOCAB, HIDDEN], spec.dtype);
    add("output_norm.weight".into(), &[HIDDEN], GgmlDType::F32);
    for l in 0..LAYERS {
        add(
            format!("blk.{l}.attn_norm.weight"),
            &[HIDDEN],
            GgmlDType::F32,
        );
        add(
            format!("blk.{l}.attn_q.weight"),
            &[HIDDEN, HIDDEN],
            spec.dtype,
        );
        add(format!("blk.{l}.attn_k.weight"), &[kv, HIDDEN], spec.dtype);
        add(format!("blk.{l}.attn_v.weight"), &[kv, HIDDEN], spec.dtype);
        add(
            format!("blk.{l}.attn_output.weight"),
            &[HIDDEN, HIDDEN],
            spec.dtype,
        );
        add(
            format!("blk.{l}.ffn_norm.weight"),
            &[HIDDEN],
            GgmlDType::F32,
        );
        add(
            format!("blk.{l}.ffn_gate.weight"),
            &[FFN, HIDDEN],
            spec.dtype,
        );
        add(format!("blk.{l}.ffn_up.weight"), &[FFN, HIDDEN], spec.dtype);
        add(
            format!("blk.{l}.ffn_down.weight"),
            &[HIDDEN, FFN],
            spec.dtype,
        );
    }
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String(spec.arch.into())),
        ("llama.block_count", Value::U32(LAYERS as u32)),
        ("llama.embedding_length", Value::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", Value::U32(FFN as u32)),
        ("llama.attention.head_count", Value::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Value::U32(KV_HEADS as u32)),
        ("llama.context_length", Value::U32(128)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
    ];
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors
        .iter()
        .filter(|(n, _)| Some(n.as_str()) != spec.skip_tensor)
        .map(|(n, t)| (n.as_str(), t))
        .collect();
    let mut f = std::fs::File::create(path).expect("create gguf");
    gguf_file::write(&mut f, &md_refs, &t_refs).expect("write gguf");
}

fn logits(model: &Llama, prompt: &[u32]) -> Vec<f32> {
    let mut cache = KvCache::new(model.config.n_layer, 4, 16, model.kv_slot_width());
    let out = model
        .forward(
            &mut cache,
            &[SeqInput {
                tokens: prompt,
                start_pos: 0,
                block_table: &[2, 0, 3, 1],
                want_logits: true,
                prompt_len: prompt.len(),
            }],
        )
        .expect("forward");
    out[0].clone().expect("logits")
}

#[test]
fn every_supported_tensor_type_runs_and_matches_its_f32_dequantization() {
    let prompt: Vec<u32> = (0..20).map(|i| (i * 7 + 3) % VOCAB as u32).collect();
    for &dtype in SUPPORTED_TENSOR_TYPES {
        let path = temp_file(&format!("{dtype:?}"));
        write_model(
            &path,
            &Spec {
                arch: "llama",
                dtype,
                skip_tensor: None,
            },
        );
        let exact = logits(
            &Llama::load(&path, WeightFormat::F32).expect("f32"),
            &prompt,
        );
        let mut model = Llama::load(&path, WeightFormat::Gguf).expect("gguf");
        let fast = logits(&model, &prompt);
        model.q8_decode = false;
        let f32_activations = logits(&model, &prompt);
        let scale = exact.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
        let worst = |got: &[f32]| {
            exact
                .iter()
                .zip(got)
                .map(|(a, b)| (a - b).abs() / scale)
                .fold(0f32, f32::max)
        };
        // With f32 activations Strata's kernels and candle's float paths are near-exact;
        // candle's K-quant kernels quantize activations to 8 bits whatever the setting.
        let tol = match dtype {
            GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => 0.05,
            GgmlDType::F16 | GgmlDType::BF16 => 1e-2,
            _ => 1e-3,
        };
        let w = worst(&f32_activations);
        assert!(
            w <= tol,
            "{dtype:?} with f32 activations: worst relative difference {w} > {tol}"
        );
        // By default Strata's kernels quantize 4-bit (and Q8_0 `lm_head`) activations to
        // 8 bits as well: as loose as candle's.
        let w = worst(&fast);
        assert!(
            w <= tol.max(0.05),
            "{dtype:?}: worst relative difference {w} > {}",
            tol.max(0.05)
        );
        assert!(
            exact.iter().all(|v| v.is_finite()),
            "{dtype:?}: non-finite logits"
        );
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn broken_and_unsupported_files_are_clear_errors() {
    // Not GGUF at all.
    let path = temp_file("garbage");
    std::fs::write(&path, b"definitely not a gguf file, just some bytes").expect("write");
    let err = Llama::load(&path, WeightFormat::Gguf)
        .err()
        .expect("garbage rejected");
    assert!(matches!(err, ModelError::NotGguf { .. }), "{err}");

    // Another architecture.
    write_model(
        &path,
        &Spec {
            arch: "mamba",
            dtype: GgmlDType::Q8_0,
            skip_tensor: None,
        },
    );
    let err = Llama::load(&path, WeightFormat::Gguf)
        .err()
        .expect("mamba rejected");
    assert!(err.to_string().contains("architecture `mamba`"), "{err}");

    // A missing tensor is named.
    write_model(
        &path,
        &Spec {
            arch: "llama",
            dtype: GgmlDType::Q8_0,
            skip_tensor: Some("blk.1.ffn_up.weight"),
        },
    );
    let err = Llama::load(&path, WeightFormat::Gguf)
        .err()
        .expect("missing tensor");
    assert!(err.to_string().contains("blk.1.ffn_up.weight"), "{err}");

    // Truncated: the header is intact, the tensor data is cut short.
    write_model(
        &path,
        &Spec {
            arch: "llama",
            dtype: GgmlDType::Q8_0,
            skip_tensor: None,
        },
    );
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() * 2 / 3]).expect("truncate");
    let err = Llama::load(&path, WeightFormat::Gguf)
        .err()
        .expect("truncated");
    assert!(
        err.to_string().contains("truncated") || matches!(err, ModelError::NotGguf { .. }),
        "{err}"
    );
    // Truncated inside the header.
    std::fs::write(&path, &bytes[..64]).expect("truncate header");
    let err = Llama::load(&path, WeightFormat::Gguf)
        .err()
        .expect("short header");
    assert!(matches!(err, ModelError::NotGguf { .. }), "{err}");

    // A file that does not exist.
    let err = Llama::load(&temp_file("absent"), WeightFormat::Gguf)
        .err()
        .expect("absent");
    assert!(matches!(err, ModelError::Open { .. }), "{err}");
    let _ = std::fs::remove_file(&path);
}
