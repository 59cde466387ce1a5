#!/usr/bin/env python3
"""Writes a tiny random-weight GGUF of each model family the engine runs.

Each file has the family's real metadata keys and tensor names (as llama.cpp's converter
writes them), hidden size 64, a few layers, a vocabulary of about 300 tokens with a real
tokenizer model (byte-level BPE or SentencePiece with byte fallback), and the family's
chat template. Weights are f32, drawn from a seeded generator, so the files are the same
on every run with the same numpy. The Rust tests read the committed copies in
crates/engine/tests/fixtures/families/; see README.md here for regenerating them and
their llama.cpp logits.

Usage: make_tiny.py [--out DIR] [--context N] [FAMILY ...]
"""
import argparse
import os
import sys

import numpy as np
import gguf

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "..", "crates", "engine", "tests", "fixtures", "families")

# Words the vocabularies spell as whole tokens, so prompts are not only bytes.
WORDS = ["the", "and", "to", "of", "is", "it", "you", "hello", "world", "model", "cat", "dog"]


def bytes_to_unicode():
    """GPT-2's reversible map of bytes to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def bpe_vocab(specials):
    """Byte-level BPE: the 256 byte characters, merges spelling WORDS with and without a
    leading space, then the special tokens (control)."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    have = set(tokens)

    def add_word(chars):
        cur = chars[0]
        for c in chars[1:]:
            merged = cur + c
            if merged not in have:
                merges.append(f"{cur} {c}")
                tokens.append(merged)
                have.add(merged)
            cur = merged

    for w in WORDS:
        enc = "".join(b2u[b] for b in w.encode())
        add_word(list(enc))
        add_word([b2u[ord(" ")]] + list(enc))
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for s in specials:
        tokens.append(s)
        types.append(gguf.TokenType.CONTROL)
    return tokens, types, merges


def spm_vocab(head, specials):
    """SentencePiece with byte fallback: `head` control tokens first (their roles are the
    caller's), the 256 byte tokens, single letters, then WORDS with the ▁ space mark,
    then `specials` (control). Longer pieces score higher."""
    tokens, types, scores = [], [], []
    for t, kind in head:
        tokens.append(t)
        types.append(kind)
        scores.append(0.0)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(gguf.TokenType.BYTE)
        scores.append(0.0)
    pieces = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    # Every prefix of each word, so that pairwise merging can reach the whole word.
    for w in WORDS:
        for word in ("▁" + w, w):
            pieces += [word[:n] for n in range(2, len(word) + 1)]
    seen = set()
    for i, p in enumerate(pieces):
        if p in seen:
            continue
        seen.add(p)
        tokens.append(p)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-1000.0 + 10.0 * len(p) - 0.001 * i)
    for s in specials:
        tokens.append(s)
        types.append(gguf.TokenType.CONTROL)
        scores.append(0.0)
    return tokens, types, scores


def template(name):
    with open(os.path.join(HERE, "templates", name + ".jinja"), encoding="utf-8") as f:
        return f.read()


class Weights:
    """Seeded random tensors: matrices scaled by 1/sqrt(fan_in), norms near 1."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def mat(self, rows, cols, gain=1.0):
        return (self.rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(self, n, base=1.0):
        return (base + 0.1 * self.rng.standard_normal(n)).astype(np.float32)

    def vec(self, n, scale=0.1):
        return (scale * self.rng.standard_normal(n)).astype(np.float32)


# name -> spec. Shared keys: hidden 64, context 256, eps 1e-6.
FAMILIES = {
    # Llama 3 with its frequency factors (rope_freqs.weight), GQA 4/2.
    "llama3": dict(arch="llama", layers=2, heads=4, kv=2, head_dim=16, ffn=64,
                   rope_base=500000.0, rope_freqs=[1, 1, 1, 1.5, 3, 5, 8, 8],
                   tok="bpe", pre="llama-bpe", tmpl="llama3"),
    # Llama/Mistral with YaRN scaling of a short original context.
    "llama_yarn": dict(arch="llama", layers=2, heads=4, kv=2, head_dim=16, ffn=32,
                       rope_base=10000.0, yarn=(4.0, 64), untied=True, tok="spm_llama",
                       tmpl="mistral"),
    # Qwen 2: Q/K/V biases.
    "qwen2": dict(arch="qwen2", layers=2, heads=4, kv=2, head_dim=16, ffn=64,
                  rope_base=1000000.0, qkv_bias=True, tok="bpe", pre="qwen2", tmpl="qwen2"),
    # Qwen 3: per-head Q/K RMSNorm, head_dim given by key_length.
    "qwen3": dict(arch="qwen3", layers=2, heads=4, kv=2, head_dim=16, ffn=64,
                  rope_base=1000000.0, qk_norm=True, key_length=True, tok="bpe", pre="qwen2",
                  tmpl="qwen3"),
    # Phi-3: fused attn_qkv (GQA, as Phi-3 medium) and gate+up in ffn_up.
    "phi3": dict(arch="phi3", layers=2, heads=4, kv=2, head_dim=16, ffn=64,
                 rope_base=10000.0, fused=True, tok="spm_llama", tmpl="phi3"),
    # Gemma 2: embedding scale, post-norms, GeGLU, soft-caps, sliding layer 0 (window 8).
    "gemma2": dict(arch="gemma2", layers=2, heads=4, kv=2, head_dim=16, ffn=64,
                   rope_base=10000.0, key_length=True, post_norms=True, window=8,
                   attn_softcap=3.0, final_softcap=12.0, tok="spm_gemma", tmpl="gemma"),
    # Gemma 3: head_dim 16 of 2 heads (not hidden/heads), Q/K norms, five sliding layers then a global one, local RoPE base 10000,
    # global base 1e6 with linear scaling 8.
    "gemma3": dict(arch="gemma3", layers=6, heads=2, kv=1, head_dim=16, ffn=16,
                   rope_base=1000000.0, linear=8.0, key_length=True, post_norms=True,
                   qk_norm=True, window=8, tok="spm_gemma", tmpl="gemma"),
}

HIDDEN = 64
CONTEXT = 256


def write_tokenizer(w, spec):
    kind = spec["tok"]
    if kind == "bpe":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        tokens, types, merges = bpe_vocab(specials)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(spec["pre"])
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        if spec["pre"] == "llama-bpe":
            w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
            w.add_eos_token_id(tokens.index("<|eot_id|>"))
            w.add_add_bos_token(True)
        else:
            w.add_eos_token_id(tokens.index("<|im_end|>"))
            w.add_pad_token_id(tokens.index("<|endoftext|>"))
            w.add_add_bos_token(False)
    elif kind == "spm_llama":
        head = [("<unk>", gguf.TokenType.UNKNOWN), ("<s>", gguf.TokenType.CONTROL),
                ("</s>", gguf.TokenType.CONTROL)]
        specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "[INST]",
                    "[/INST]"]
        tokens, types, scores = spm_vocab(head, specials)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
    else:  # spm_gemma
        head = [("<pad>", gguf.TokenType.CONTROL), ("<eos>", gguf.TokenType.CONTROL),
                ("<bos>", gguf.TokenType.CONTROL), ("<unk>", gguf.TokenType.UNKNOWN)]
        specials = ["<start_of_turn>", "<end_of_turn>"]
        tokens, types, scores = spm_vocab(head, specials)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_pad_token_id(0)
        w.add_eos_token_id(1)
        w.add_bos_token_id(2)
        w.add_unk_token_id(3)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
    w.add_chat_template(template(spec["tmpl"]))
    return len(tokens)


def write_family(name, spec, out_dir, seed, context=None):
    arch = spec["arch"]
    path = os.path.join(out_dir, f"{name}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{name}")
    vocab = write_tokenizer(w, spec)
    L, nh, nkv, hd, ffn = spec["layers"], spec["heads"], spec["kv"], spec["head_dim"], spec["ffn"]
    q_dim, kv_dim = nh * hd, nkv * hd
    w.add_context_length(context or CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(L)
    w.add_feed_forward_length(ffn)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(spec["rope_base"])
    if spec.get("key_length"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    if "yarn" in spec:
        factor, orig = spec["yarn"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(orig)
    if "linear" in spec:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec["linear"])
    if "window" in spec:
        w.add_sliding_window(spec["window"])
    if "attn_softcap" in spec:
        w.add_attn_logit_softcapping(spec["attn_softcap"])
        w.add_final_logit_softcapping(spec["final_softcap"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    r = Weights(seed)
    w.add_tensor("token_embd.weight", r.mat(vocab, HIDDEN, gain=1.0))
    w.add_tensor("output_norm.weight", r.norm(HIDDEN, 3.0))
    if spec.get("untied"):
        w.add_tensor("output.weight", r.mat(vocab, HIDDEN, gain=1.0))
    if "rope_freqs" in spec:
        w.add_tensor("rope_freqs.weight", np.array(spec["rope_freqs"], dtype=np.float32))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", r.norm(HIDDEN))
        if spec.get("fused"):
            w.add_tensor(p + "attn_qkv.weight", r.mat(q_dim + 2 * kv_dim, HIDDEN))
        else:
            w.add_tensor(p + "attn_q.weight", r.mat(q_dim, HIDDEN, gain=2.0))
            w.add_tensor(p + "attn_k.weight", r.mat(kv_dim, HIDDEN, gain=2.0))
            w.add_tensor(p + "attn_v.weight", r.mat(kv_dim, HIDDEN))
            if spec.get("qkv_bias"):
                w.add_tensor(p + "attn_q.bias", r.vec(q_dim, 0.5))
                w.add_tensor(p + "attn_k.bias", r.vec(kv_dim, 0.5))
                w.add_tensor(p + "attn_v.bias", r.vec(kv_dim, 0.5))
        if spec.get("qk_norm"):
            w.add_tensor(p + "attn_q_norm.weight", r.norm(hd, 2.0))
            w.add_tensor(p + "attn_k_norm.weight", r.norm(hd, 2.0))
        w.add_tensor(p + "attn_output.weight", r.mat(HIDDEN, q_dim, gain=2.0))
        if spec.get("post_norms"):
            w.add_tensor(p + "post_attention_norm.weight", r.norm(HIDDEN))
        w.add_tensor(p + "ffn_norm.weight", r.norm(HIDDEN))
        if spec.get("fused"):
            w.add_tensor(p + "ffn_up.weight", r.mat(2 * ffn, HIDDEN))
        else:
            w.add_tensor(p + "ffn_gate.weight", r.mat(ffn, HIDDEN))
            w.add_tensor(p + "ffn_up.weight", r.mat(ffn, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", r.mat(HIDDEN, ffn, gain=2.0))
        if spec.get("post_norms"):
            w.add_tensor(p + "post_ffw_norm.weight", r.norm(HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--context", type=int, default=None,
                    help=f"context_length to write (default {CONTEXT}; benchmarks need 640+)")
    ap.add_argument("families", nargs="*", default=list(FAMILIES))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for i, name in enumerate(FAMILIES):
        if name not in args.families:
            continue
        path = write_family(name, FAMILIES[name], args.out, seed=1000 + i, context=args.context)
        print(f"{path}: {os.path.getsize(path)} bytes")
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        sys.exit(f"unknown families: {sorted(unknown)}")


if __name__ == "__main__":
    main()
