#!/usr/bin/env python3
"""Generate crates/engine/tests/fixtures/block_hashes.json: vLLM V1 prefix-cache block
hashes in `sha256_cbor` mode, computed the way vLLM computes them.

The functions below restate, with Python's `cbor2` and `hashlib`, what vLLM does in
`vllm/utils/hashing.py` (`sha256_cbor`) and `vllm/v1/core/kv_cache_utils.py`
(`init_none_hash` / `resolve_none_hash_seed`, `generate_block_hash_extra_keys`,
`hash_block_tokens`, `get_request_block_hasher`, `maybe_convert_block_hash`), for text
requests (no multimodal inputs, no prompt embeddings). The Rust side
(`crates/engine/src/kv/hashing.rs`) must reproduce every NONE_HASH, every block hash
and its 64-bit wire form.

Usage (cbor2 is the only dependency; a throwaway venv is enough):
    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install cbor2
    /tmp/venv/bin/python tools/reference/block_hash_fixture.py \
        --out crates/engine/tests/fixtures/block_hashes.json
"""

import argparse
import hashlib
import importlib.metadata
import json
import re
from pathlib import Path

import cbor2

# vLLM's DEFAULT_NONE_HASH_SEED: the seed of NONE_HASH for sha256 / sha256_cbor when
# PYTHONHASHSEED is unset (vLLM #51875; before it an unset seed meant os.urandom(32)).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256_cbor(obj) -> bytes:
    """vllm.utils.hashing.sha256_cbor."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(seed: str) -> bytes:
    """init_none_hash: the seed string itself (os.getenv returns str) goes through the
    hash function, so its CBOR is a text string."""
    return sha256_cbor(seed)


def extra_keys(block_index: int, lora_name, cache_salt):
    """generate_block_hash_extra_keys for a text request: LoRA name on every block, then
    the cache salt on the first block when truthy; no keys means None."""
    keys = []
    if lora_name is not None:
        keys.append(lora_name)
    if block_index == 0 and cache_salt:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def hash_block_tokens(root: bytes, parent, tokens, extra):
    """hash_block_tokens: a falsy parent becomes NONE_HASH, tokens become a tuple."""
    if not parent:
        parent = root
    return sha256_cbor((parent, tuple(tokens), extra))


def request_block_hashes(root: bytes, block_size: int, tokens, lora_name, cache_salt):
    """get_request_block_hasher over a whole request: full blocks only, chained."""
    hashes = []
    start = 0
    while start + block_size <= len(tokens):
        index = start // block_size
        parent = hashes[-1] if hashes else None
        hashes.append(
            hash_block_tokens(
                root,
                parent,
                tokens[start : start + block_size],
                extra_keys(index, lora_name, cache_salt),
            )
        )
        start += block_size
    return hashes


def to_u64(digest: bytes) -> int:
    """maybe_convert_block_hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (default)."""
    return int.from_bytes(digest, byteorder="big") & ((1 << 64) - 1)


def cases():
    llama3 = [128000, 128006, 9125, 128007, 271, 0, 1, 127, 128, 255, 256, 65535, 65536, 128255, 42, 2]
    yield "default seed, one block", DEFAULT_NONE_HASH_SEED, 16, list(range(16)), None, None
    yield "default seed, partial last block", DEFAULT_NONE_HASH_SEED, 16, list(range(1000, 1050)), None, None
    yield "large token ids", DEFAULT_NONE_HASH_SEED, 16, llama3 + [151643, 151644, 4294967295, 16777216] * 4 + [7], None, None
    yield "seed 0", "0", 16, llama3 * 3, None, None
    yield "seed 42, block size 4", "42", 4, list(range(0, 4000, 97)), None, None
    yield "block size 32 (array length 32)", "0", 32, [(i * 7919) % 130000 for i in range(100)], None, None
    yield "lora name", DEFAULT_NONE_HASH_SEED, 16, list(range(40)), "sql-adapter", None
    yield "cache salt", DEFAULT_NONE_HASH_SEED, 16, list(range(40)), None, "tenant-a"
    yield "lora and salt", "0", 16, list(range(48)), "adapter", "tenant-b"
    yield "empty salt is no salt", DEFAULT_NONE_HASH_SEED, 16, list(range(32)), None, ""
    yield "long unicode salt", DEFAULT_NONE_HASH_SEED, 8, list(range(24)), None, "sel-é-" + "x" * 300
    yield "lora name 24 bytes", "0", 8, list(range(17)), "a" * 24, None
    yield "shorter than a block", DEFAULT_NONE_HASH_SEED, 16, list(range(15)), None, "s"
    yield "no tokens", "0", 16, [], None, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    out = []
    for name, seed, block_size, tokens, lora_name, cache_salt in cases():
        root = none_hash(seed)
        hashes = request_block_hashes(root, block_size, tokens, lora_name, cache_salt)
        first_cbor = None
        if len(tokens) >= block_size:
            first_cbor = cbor2.dumps(
                (root, tuple(tokens[:block_size]), extra_keys(0, lora_name, cache_salt)),
                canonical=True,
            ).hex()
        out.append(
            {
                "name": name,
                "seed": seed,
                "block_size": block_size,
                "tokens": tokens,
                "lora_name": lora_name,
                "cache_salt": cache_salt,
                "none_hash": root.hex(),
                "first_block_cbor": first_cbor,
                "hashes": [{"hex": h.hex(), "u64": to_u64(h)} for h in hashes],
            }
        )

    doc = {
        "generator": "tools/reference/block_hash_fixture.py",
        "cbor2_version": importlib.metadata.version("cbor2"),
        "algorithm": "vLLM V1 sha256_cbor block hashes",
        "cases": out,
    }
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    # Keep integer lists (token ids) on one line.
    text = re.sub(
        r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )
    args.out.write_text(text + "\n")
    print(f"wrote {args.out}: {len(out)} cases, {sum(len(c['hashes']) for c in out)} hashes")


if __name__ == "__main__":
    main()
