//! Times the block kernels on the default model's shapes (no model file needed):
//! `cargo run --release -p strata-engine --example kernel_bench -- [M ...]`. Each type runs
//! twice: f32 activations (`q4_1`, `q8_0`) and 8-bit decode activations (`q4_1/q8`,
//! `q8_0/q8`).
use std::time::Instant;

use strata_engine::kernels::{BlockMatrix, BlockType};

fn main() {
    let ms: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let ms = if ms.is_empty() {
        vec![1, 2, 16, 64, 512]
    } else {
        ms
    };
    let mut seed = 1u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for (kind, name) in [(BlockType::Q4_1, "q4_1"), (BlockType::Q8_0, "q8_0")] {
        for (n, k) in [(576, 576), (3072, 576), (576, 1536), (49152, 576)] {
            let blocks = n * k / 32;
            let mut data = Vec::with_capacity(blocks * kind.block_bytes());
            for _ in 0..blocks {
                data.extend_from_slice(&half::f16::from_f32(0.01).to_bits().to_le_bytes());
                if kind == BlockType::Q4_1 {
                    data.extend_from_slice(&half::f16::from_f32(-0.05).to_bits().to_le_bytes());
                }
                let header = if kind == BlockType::Q4_1 { 4 } else { 2 };
                for _ in header..kind.block_bytes() {
                    data.push(rnd() as u8);
                }
            }
            // Q8_0 as the model keeps its `lm_head`: with the 8-bit decode-row path too.
            let w = BlockMatrix::new(kind, n, k, data)
                .expect("blocks")
                .with_q8_decode_rows();
            let modes: &[(&str, bool)] = if w.takes_q8_activations() {
                &[("", false), ("/q8", true)]
            } else {
                &[("", false)]
            };
            for (&m, &(suffix, q8)) in ms.iter().flat_map(|m| modes.iter().map(move |q| (m, q))) {
                if n == 49152 && m > 64 {
                    continue;
                }
                let x: Vec<f32> = (0..m * k).map(|_| (rnd() % 1000) as f32 / 1000.0).collect();
                let reps = (2_000_000_000 / (m * n * k)).clamp(3, 2000);
                let exact = if q8 { 0 } else { m };
                let _ = w.matmul_split(&x, m, exact);
                let t = Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(w.matmul_split(&x, m, exact));
                }
                let s = t.elapsed().as_secs_f64() / reps as f64;
                let name = format!("{name}{suffix}");
                println!(
                    "{name:<7} n={n:>5} k={k:>4} m={m:>3}: {:>9.1} us  {:>6.1} GFLOP/s  {:>5.1} GB/s weights",
                    s * 1e6,
                    2.0 * (m * n * k) as f64 / s / 1e9,
                    w.size_bytes() as f64 / s / 1e9
                );
            }
        }
    }
}
