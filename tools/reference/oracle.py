#!/usr/bin/env python3
"""Reference oracle for Strata's LLM engine.

Loads a llama-architecture GGUF (by default SmolLM2-135M-Instruct, Q4_1) with
Hugging Face transformers, dequantized to float32, runs greedy decoding on a
fixed set of prompts and writes the raw logits' top-5 at every step to a JSON
fixture that the engine's Rust tests compare against.

Before generating anything the script checks that what transformers built is
really the model in the file:
  * the config (layers, widths, heads, rope theta, RMSNorm eps, tied
    embeddings, ...) is compared with the GGUF metadata;
  * every weight is compared, exactly, with our own decoding of the raw GGUF
    blocks (Q4_1 / Q8_0 / F32 decoders written below, independent of both
    transformers and the `gguf` package's dequantizer), after undoing the
    row permutation llama.cpp applies to the Q and K projections;
  * the tokenizer's BOS behaviour follows `tokenizer.ggml.add_bos_token`.
After generating, the step-by-step (KV-cached) logits are checked against one
uncached forward pass over the whole sequence.

Usage:
    python oracle.py --model PATH/TO/model.gguf --out PATH/TO/fixture.json

Everything runs on the CPU in float32; torch is limited to one thread by
default (--threads) so that the results do not depend on the machine's core
count more than necessary and the script stays light on shared machines.
"""

import argparse
import hashlib
import inspect
import json
import os
import sys
import time
from pathlib import Path

# Keep BLAS/OpenMP to one thread unless the caller asked otherwise. This must
# happen before numpy/torch are imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import gguf  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = Path.home() / ".cache/strata/models/smollm2-135m-instruct.gguf"
DEFAULT_OUT = REPO_ROOT / "crates/engine/tests/fixtures/reference_smollm2.json"
# SHA-256 of the GGUF the committed fixture was generated from.
EXPECTED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------

PARAGRAPH = (
    "The printing press, developed by Johannes Gutenberg around 1440, changed "
    "the way knowledge moved through Europe. Before it, books were copied by "
    "hand, usually by monks working in quiet rooms, and a single volume could "
    "take months to finish. Movable metal type made it possible to produce "
    "hundreds of identical pages in a day. Prices fell, literacy rose, and "
    "ideas that once stayed inside a monastery or a university could now reach "
    "merchants, farmers and craftsmen. Within fifty years, presses were running "
    "in more than two hundred cities, and millions of books had been printed. "
    "Historians still argue about how much the press caused the Reformation "
    "and the scientific revolution, but few doubt that"
)

# Plain-text prompts are fed to the model as they are (BOS only if the GGUF
# asks for one).
TEXT_CASES = [
    ("text_capital_france", "The capital of France is"),
    ("text_code_fibonacci", "def fibonacci(n):"),
    ("text_number_list", "1, 2, 3, 4,"),
    ("text_long_paragraph", PARAGRAPH),
    # Runs of spaces before digits: the one place where SmolLM's pre-tokenizer
    # (digits split off first) differs from a plain GPT-2 byte-level split.
    ("text_spaced_numbers", "Inventory:\n  apples =   12\n  pears  =    7\n  total  ="),
]

# Chat prompts are rendered with the model's own chat template
# (add_generation_prompt=True); the rendered string is what gets tokenized.
CHAT_CASES = [
    ("chat_capital_france", [
        {"role": "user", "content": "What is the capital of France?"},
    ]),
    ("chat_system_user", [
        {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ]),
    ("chat_multi_turn", [
        {"role": "user", "content": "Hi! Can you help me with some arithmetic?"},
        {"role": "assistant", "content": "Of course! What would you like to calculate?"},
        {"role": "user", "content": "What is 12 times 7?"},
    ]),
    ("chat_unicode_emoji", [
        {"role": "user", "content": "What do the emojis 🍕🍔 mean, and how do you say pizza in Japanese (日本語)?"},
    ]),
]

# ---------------------------------------------------------------------------
# GGUF metadata and raw tensor decoding
# ---------------------------------------------------------------------------


def gguf_metadata(reader):
    """The scalar/string metadata of a GGUF as a plain dict (big arrays skipped)."""
    meta = {}
    for key, field in reader.fields.items():
        if len(field.data) > 1024:  # token lists, merges, scores
            continue
        meta[key] = field.contents()
    return meta


def decode_f16_scales(blocks, start):
    """Read an fp16 scale stored at byte offset `start` of each block."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def decode_raw_tensor(tensor):
    """Decode one GGUF tensor into a float32 array of shape (rows, cols).

    Written from the GGML block layouts, independently of the `gguf` package's
    own dequantizer, so that the two can check each other.
    """
    qtype = tensor.tensor_type
    # GGUF lists dimensions fastest-first; numpy wants them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    raw = np.asarray(tensor.data)
    T = gguf.GGMLQuantizationType
    if qtype == T.F32:
        return raw.astype(np.float32).reshape(shape)
    if qtype == T.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    blocks = raw.view(np.uint8).reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    if qtype == T.Q4_1:
        # block of 32: fp16 d, fp16 m, 16 bytes; x[j] = d * nibble + m, with
        # the low nibbles holding j = 0..15 and the high nibbles j = 16..31.
        d = decode_f16_scales(blocks, 0)
        m = decode_f16_scales(blocks, 2)
        qs = blocks[:, 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        return (d * q + m).reshape(shape)
    if qtype == T.Q8_0:
        # block of 32: fp16 d, 32 signed bytes; x[j] = d * q[j].
        d = decode_f16_scales(blocks, 0)
        q = blocks[:, 2:34].view(np.int8).astype(np.float32)
        return (d * q).reshape(shape)
    raise NotImplementedError(f"no reference decoder for {qtype.name} ({tensor.name})")


def unpermute_qk(w, n_head):
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter interleaves the two rotary halves of every head
    (GGML rotates adjacent pairs); Hugging Face's Llama keeps them as two
    contiguous halves (rotate_half). Per head: GGUF rows are
    (pair, member) -> HF rows are (member, pair).
    """
    rows, cols = w.shape
    head_dim = rows // n_head
    return w.reshape(n_head, head_dim // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def hf_param_name(gguf_name):
    """Map a llama GGUF tensor name to the Hugging Face parameter name."""
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in top:
        return top[gguf_name]
    blk, idx, part, suffix = gguf_name.split(".")
    assert blk == "blk" and suffix == "weight", gguf_name
    per_layer = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    return f"model.layers.{idx}.{per_layer[part]}.weight"


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def check_config(meta, config):
    """Compare the transformers config with the GGUF metadata; print both."""
    arch = meta["general.architecture"]
    assert arch == "llama", f"this oracle handles llama GGUFs, not {arch!r}"
    rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if rope_theta is None:  # older transformers keep it at the top level
        rope_theta = config.rope_theta
    n_head = meta[f"{arch}.attention.head_count"]
    pairs = [
        ("layers", meta[f"{arch}.block_count"], config.num_hidden_layers),
        ("hidden", meta[f"{arch}.embedding_length"], config.hidden_size),
        ("ffn", meta[f"{arch}.feed_forward_length"], config.intermediate_size),
        ("heads", n_head, config.num_attention_heads),
        ("kv_heads", meta[f"{arch}.attention.head_count_kv"], config.num_key_value_heads),
        ("head_dim", meta.get(f"{arch}.rope.dimension_count", config.hidden_size // n_head),
         config.head_dim),
        ("vocab", meta.get(f"{arch}.vocab_size", config.vocab_size), config.vocab_size),
        ("rope_theta", meta[f"{arch}.rope.freq_base"], rope_theta),
        ("rms_eps", meta[f"{arch}.attention.layer_norm_rms_epsilon"], config.rms_norm_eps),
    ]
    print("config (gguf metadata vs transformers):")
    for name, want, got in pairs:
        ok = want == got
        print(f"  {name:11s} {want!r:>24} {got!r:>24}  {'ok' if ok else 'MISMATCH'}")
        assert ok, f"config mismatch on {name}: gguf {want!r}, transformers {got!r}"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    assert rope_type == "default", f"unexpected rope scaling {rope_type!r}"
    print(f"  rope_type   {rope_type}")


def check_weights(reader, model, n_head, n_kv_head):
    """Every weight of the loaded model must equal our decode of the GGUF."""
    params = dict(model.named_parameters(remove_duplicate=False))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    print(f"tie_word_embeddings: config={model.config.tie_word_embeddings} "
          f"lm_head shares embed_tokens={tied} gguf has output.weight={has_output}")
    assert model.config.tie_word_embeddings == (not has_output)
    assert tied == (not has_output)

    # Every projection must be a plain dense float32 Linear (no packed blocks).
    for name, module in model.named_modules():
        if name.endswith("_proj") or name == "lm_head":
            assert type(module) is torch.nn.Linear, f"{name} is {type(module).__name__}"
    for name, p in params.items():
        assert p.dtype == torch.float32, f"{name} is {p.dtype}"

    seen = set()
    counts = {}
    worst_pkg = 0.0
    for t in reader.tensors:
        ours = decode_raw_tensor(t)
        # Cross-check our decoder with the gguf package's.
        pkg = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ours.shape)
        worst_pkg = max(worst_pkg, float(np.max(np.abs(pkg - ours))))
        if ".attn_q." in t.name:
            ours = unpermute_qk(ours, n_head)
        elif ".attn_k." in t.name:
            ours = unpermute_qk(ours, n_kv_head)
        name = hf_param_name(t.name)
        got = params[name].detach().cpu().numpy()
        assert got.shape == ours.shape, f"{name}: {got.shape} vs {ours.shape}"
        if not np.array_equal(got, ours):
            diff = float(np.max(np.abs(got - ours)))
            raise AssertionError(f"{name} differs from the GGUF's {t.name} (max |diff| {diff})")
        seen.add(name)
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    assert worst_pkg == 0.0, f"gguf.quants.dequantize disagrees with our decoder ({worst_pkg})"
    missing = sorted(set(params) - seen - ({"lm_head.weight"} if tied else set()))
    assert not missing, f"parameters not in the GGUF: {missing}"
    print(f"weights: all {len(seen)} tensors equal the raw GGUF decode exactly "
          f"({', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))})")

    # A Q4_1 block holds at most 16 distinct values: prove the loaded weights
    # are the dequantized 4-bit ones, not full-precision weights from elsewhere.
    w = model.model.layers[0].mlp.down_proj.weight.detach().numpy().reshape(-1, 32)
    distinct = max(len(np.unique(b)) for b in w[:4096])
    print(f"  layer 0 down_proj: at most {distinct} distinct values per 32-weight block")
    assert distinct <= 16


def tokenizer_fixups(tokenizer, meta):
    """Bring the GGUF-derived HF tokenizer in line with the original.

    transformers rebuilds a GPT-2 style byte-level BPE from the GGUF but
    ignores `tokenizer.ggml.pre`. SmolLM's pre-tokenizer ("smollm" in
    llama.cpp, and the original tokenizer.json) first splits every digit off
    on its own, then applies the GPT-2 byte-level regex. Restore that.
    """
    pre = meta.get("tokenizer.ggml.pre")
    if pre == "smollm":
        from tokenizers import pre_tokenizers
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        print("tokenizer: pre-tokenizer set to Digits(individual) + ByteLevel (gguf pre = smollm)")
    elif pre not in (None, "default", "gpt2"):
        raise NotImplementedError(f"pre-tokenizer {pre!r} not handled")


# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------


def f32(x):
    """A float32 as the shortest decimal that reads back as the same float32."""
    return float(str(np.float32(x)))


def top5(logits):
    """The 5 highest logits as [id, logit], by logit descending, ties by id."""
    vals, ids = torch.topk(logits, 16)
    pairs = sorted(zip(ids.tolist(), vals.tolist()), key=lambda p: (-p[1], p[0]))
    return [[i, f32(v)] for i, v in pairs[:5]]


@torch.no_grad()
def greedy(model, prompt_ids, n_steps):
    """Greedy decoding, never stopping at EOS, with raw float32 logits.

    A hand-written loop over the KV cache: no logits processors, no
    temperature, no stopping criteria. Returns (greedy ids, per-step top5,
    per-step full logits).
    """
    # transformers 5.x renamed the cache argument `past_key_values` -> `cache`.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=input_ids, use_cache=True)
    ids, steps, all_logits = [], [], []
    for _ in range(n_steps):
        logits = out.logits[0, -1].float()
        assert logits.dtype == torch.float32
        best = top5(logits)
        nxt = best[0][0]
        assert logits[nxt] == logits.max()
        ids.append(nxt)
        steps.append({"top5": best})
        all_logits.append(logits.clone())
        out = model(input_ids=torch.tensor([[nxt]]), use_cache=True,
                    **{cache_arg: getattr(out, cache_arg)})
    return ids, steps, torch.stack(all_logits)


@torch.no_grad()
def check_uncached(model, prompt_ids, greedy_ids, step_logits):
    """One forward over prompt + continuation must reproduce the cached logits."""
    seq = torch.tensor([prompt_ids + greedy_ids[:-1]])
    logits = model(input_ids=seq, use_cache=False).logits[0, len(prompt_ids) - 1:]
    return float((logits - step_logits).abs().max())


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def render_json(obj, indent=0, inline_keys=("prompt_ids", "greedy_ids", "top5")):
    """JSON with one line per step/id list, so the fixture stays readable."""
    pad = " " * indent
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if k in inline_keys or not isinstance(v, (dict, list)):
                body = json.dumps(v, ensure_ascii=False)
            else:
                body = render_json(v, indent + 2, inline_keys)
            items.append(f'{pad}  {json.dumps(k)}: {body}')
        if all(k in inline_keys or not isinstance(v, (dict, list)) for k, v in obj.items()):
            return "{" + ", ".join(i.strip() for i in items) + "}"  # e.g. one step per line
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list):
        inner = [f"{pad}  {render_json(v, indent + 2, inline_keys)}" for v in obj]
        return "[\n" + ",\n".join(inner) + f"\n{pad}]"
    return json.dumps(obj, ensure_ascii=False)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="path to the GGUF")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture to write")
    ap.add_argument("--steps", type=int, default=32, help="greedy tokens per case")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    t0 = time.time()

    digest = sha256(args.model)
    print(f"model {args.model}\n  sha256 {digest}")
    if digest != EXPECTED_SHA256:
        print("  WARNING: not the GGUF the committed fixture was made from", file=sys.stderr)

    reader = gguf.GGUFReader(str(args.model))
    meta = gguf_metadata(reader)
    arch = meta["general.architecture"]
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    print(f"gguf: arch={arch} name={meta.get('general.name')!r} file_type={meta.get('general.file_type')} "
          f"rope.freq_base={meta[f'{arch}.rope.freq_base']} "
          f"rms_eps={meta[f'{arch}.attention.layer_norm_rms_epsilon']!r} add_bos_token={add_bos}")

    model_dir, model_file = str(args.model.parent), args.model.name
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_file)
    tokenizer_fixups(tokenizer, meta)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        gguf_file=model_file,
        dtype=torch.float32,
        # Unpack every block into dense float32 weights at load time.
        quantization_config=GgufConfig(dequantize=True),
        attn_implementation="eager",
    ).eval()
    print(f"loaded in {time.time() - t0:.1f}s: {type(model).__name__}")

    check_config(meta, model.config)
    check_weights(reader, model, model.config.num_attention_heads, model.config.num_key_value_heads)

    # Tokenizer sanity: BOS only when the GGUF asks for it, chat markers atomic.
    probe = tokenizer("Hello", add_special_tokens=True)["input_ids"]
    assert (probe[0] == tokenizer.bos_token_id) == add_bos, f"BOS handling differs from gguf: {probe}"
    for marker in ("<|im_start|>", "<|im_end|>"):
        assert len(tokenizer(marker, add_special_tokens=False)["input_ids"]) == 1, marker
    assert tokenizer.chat_template == meta.get("tokenizer.chat_template"), "chat template differs"

    def encode_raw(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(text):
        return ([tokenizer.bos_token_id] if add_bos else []) + encode_raw(text)

    prompts = [(name, "text", text) for name, text in TEXT_CASES]
    for name, messages in CHAT_CASES:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append((name, "chat", rendered))

    cases = []
    for name, kind, prompt in prompts:
        # Plain text gets a BOS only if the GGUF asks for one; a rendered chat
        # template already carries its own markers, so it is tokenized as is.
        prompt_ids = encode(prompt) if kind == "text" else encode_raw(prompt)
        assert tokenizer.decode(prompt_ids) == prompt, f"{name}: tokenization does not round-trip"
        ids, steps, step_logits = greedy(model, prompt_ids, args.steps)
        drift = check_uncached(model, prompt_ids, ids, step_logits)
        # How close greedy came to a tie: an engine whose float32 rounding
        # differs slightly may legitimately diverge after such a step.
        gaps = [s["top5"][0][1] - s["top5"][1][1] for s in steps]
        margin = min(gaps)
        print(f"\n[{name}] {kind}, {len(prompt_ids)} prompt tokens, "
              f"cached-vs-uncached max |dlogit| {drift:.2e}, smallest top1-top2 gap {margin:.4f} (step {gaps.index(margin)})")
        assert drift < 1e-3, f"{name}: KV-cached logits drift from the full forward ({drift})"
        print(f"  prompt: {prompt!r}")
        print(f"  greedy: {tokenizer.decode(ids)!r}")
        cases.append({
            "name": name,
            "kind": kind,
            "prompt": prompt,
            "prompt_ids": prompt_ids,
            "greedy_ids": ids,
            "steps": steps,
        })

    fixture = {
        "model": args.model.stem,
        "model_sha256": digest,
        "generator": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": _version("gguf"),
            "dtype": "float32",
        },
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = render_json(fixture) + "\n"
    json.loads(text)  # make sure the hand-laid-out JSON parses
    args.out.write_text(text, encoding="utf-8")
    print(f"\nwrote {args.out} ({len(text.encode())} bytes, {len(cases)} cases) in {time.time() - t0:.1f}s")


def _version(dist):
    from importlib.metadata import version
    return version(dist)


if __name__ == "__main__":
    main()
