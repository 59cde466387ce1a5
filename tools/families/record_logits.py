#!/usr/bin/env python3
"""Records llama.cpp's reference for each tiny family GGUF: its tokenization of a small
corpus, and for each prompt the logits after the prompt and after each of its greedy
tokens (top entries) with the greedy continuation. Written to
crates/engine/tests/fixtures/families/<family>.json, which the engine's
tests/families.rs compares against.

Runs llama.cpp through llama-cpp-python (README.md says which version and how to install
it), with f32 KV entries so that the only differences left are floating-point order.

Usage: record_logits.py [--dir DIR] [FAMILY ...]
"""
import argparse
import hashlib
import json
import os

import numpy as np
from llama_cpp import Llama

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(HERE, "..", "..", "crates", "engine", "tests", "fixtures", "families")

# Prompts as text (tokenized by llama.cpp with the file's BOS rule) or as raw ids.
PROMPTS = [
    ("hello", "hello world"),
    ("sentence", "the cat and the dog is it you, the model of the world"),
    ("bytes", "héllo wörld: the cat 🐱 is 42!"),
    # Longer than every sliding window of the fixtures (8), so window layers drop keys.
    ("long", "the dog and the cat of the world is the model, it is you and the cat, "
             "hello the dog of the model and the world"),
]
# Texts whose tokenization the tokenizer tests compare (no special-token parsing).
CORPUS = [
    "hello world",
    " hello  world ",
    "The Cat and the DOG!",
    "it's 12345 cats, you'll see",
    "héllo wörld 🐱 ünïcode — dash",
    "line one\nline two\n\n  indented\ttab",
    "model:the,cat;dog.",
    "",
]
# Chat-formatted texts tokenized with special tokens parsed: each family's markers are
# special tokens in its own vocabulary and plain text in the others'. Phi-3's specials
# strip the whitespace after them in llama.cpp (its files' names say phi3).
SPECIAL_CORPUS = [
    "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n",
    "<|user|>\n hello the cat <|end|>\n<|assistant|>\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<s> [INST] hi the dog [/INST] it is</s>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>",
]
STEPS = 12
TOP = 10


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def top_entries(row):
    idx = np.argsort(-row, kind="stable")[:TOP]
    return [[int(i), float(row[i])] for i in idx]


def run_case(llm, prompt_ids):
    llm.reset()
    llm.eval(prompt_ids)
    steps, greedy = [], []
    row = np.array(llm.scores[len(prompt_ids) - 1], dtype=np.float32)
    for _ in range(STEPS):
        steps.append({"top": top_entries(row)})
        tok = int(np.argmax(row))
        greedy.append(tok)
        llm.eval([tok])
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    return steps, greedy


def record(path):
    llm = Llama(model_path=path, n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True,
                type_k=0, type_v=0, n_threads=2, verbose=False, seed=0)
    cases = []
    for name, text in PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        steps, greedy = run_case(llm, ids)
        cases.append({"name": name, "prompt_ids": ids, "greedy_ids": greedy, "steps": steps})
    corpus = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=False)}
              for t in CORPUS]
    special = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)}
               for t in SPECIAL_CORPUS]
    return {
        "model_sha256": sha256(path),
        "reference": "llama.cpp via llama-cpp-python, f32 KV",
        "cases": cases,
        "tokenize": corpus,
        "tokenize_special": special,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=DEFAULT_DIR)
    ap.add_argument("families", nargs="*")
    args = ap.parse_args()
    names = args.families or sorted(f[:-5] for f in os.listdir(args.dir) if f.endswith(".gguf"))
    for name in names:
        path = os.path.join(args.dir, f"{name}.gguf")
        fx = record(path)
        out = os.path.join(args.dir, f"{name}.json")
        with open(out, "w", encoding="utf-8") as f:
            json.dump(fx, f, ensure_ascii=False, indent=1)
            f.write("\n")
        greedy = [c["greedy_ids"][:4] for c in fx["cases"]]
        print(f"{out}: {len(fx['cases'])} cases, greedy starts {greedy}")


if __name__ == "__main__":
    main()
