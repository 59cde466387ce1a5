#!/usr/bin/env python3
"""Writes a small PEFT LoRA adapter for the default model (SmolLM2-135M) with a fixed seed.

Usage: python3 tools/make_lora_adapter.py OUT_DIR [--rank R] [--alpha A] [--seed S]
           [--targets q_proj,v_proj] [--layers N] [--zero-b] [--std X]

OUT_DIR gets adapter_config.json and adapter_model.safetensors (f32), named and shaped the
way PEFT saves them: base_model.model.model.layers.{i}.{self_attn|mlp}.{m}.lora_A.weight is
[r, in], lora_B.weight is [out, r]. With --zero-b every B is zero, so the adapter must leave
the base model's output unchanged. Needs only the Python standard library.
"""

import argparse
import json
import os
import random
import struct

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, FFN 1536, 30 layers.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 576, 9, 3, 64, 1536, 30

DIMS = {  # module -> (block, in, out)
    "q_proj": ("self_attn", HIDDEN, HEADS * HEAD_DIM),
    "k_proj": ("self_attn", HIDDEN, KV_HEADS * HEAD_DIM),
    "v_proj": ("self_attn", HIDDEN, KV_HEADS * HEAD_DIM),
    "o_proj": ("self_attn", HEADS * HEAD_DIM, HIDDEN),
    "gate_proj": ("mlp", HIDDEN, FFN),
    "up_proj": ("mlp", HIDDEN, FFN),
    "down_proj": ("mlp", FFN, HIDDEN),
}


def write_safetensors(path, tensors):
    """tensors: name -> (shape, list of floats), stored little-endian f32."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        shape, values = tensors[name]
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--zero-b", action="store_true")
    p.add_argument("--std", type=float, default=0.02, help="std of the random A and B entries")
    args = p.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    for t in targets:
        if t not in DIMS:
            p.error(f"unknown target module {t!r}; choose from {', '.join(DIMS)}")
    rng = random.Random(args.seed)
    tensors = {}
    for layer in range(args.layers):
        for m in targets:
            block, n_in, n_out = DIMS[m]
            stem = f"base_model.model.model.layers.{layer}.{block}.{m}"
            a = [rng.gauss(0.0, args.std) for _ in range(args.rank * n_in)]
            b = [0.0] * (n_out * args.rank) if args.zero_b else [
                rng.gauss(0.0, args.std) for _ in range(n_out * args.rank)
            ]
            tensors[f"{stem}.lora_A.weight"] = ((args.rank, n_in), a)
            tensors[f"{stem}.lora_B.weight"] = ((n_out, args.rank), b)
    os.makedirs(args.out_dir, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "r": args.rank,
        "lora_alpha": args.alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "task_type": "CAUSAL_LM",
    }
    with open(os.path.join(args.out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_safetensors(os.path.join(args.out_dir, "adapter_model.safetensors"), tensors)
    print(args.out_dir)


if __name__ == "__main__":
    main()
