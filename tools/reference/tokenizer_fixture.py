#!/usr/bin/env python3
"""Generate the tokenizer reference fixtures from llama.cpp's `llama-tokenize`.

Runs llama-tokenize (built by tools/llamacpp/build.sh) over a fixed corpus and writes,
for every string, the ids llama.cpp produces:

* crates/engine/tests/fixtures/tokenizer_smollm2.json: the SmolLM2 GGUF (byte-level
  BPE, pre-tokenizer `smollm`);
* crates/engine/tests/fixtures/tokenizer_spm_synthetic.json: a synthetic SentencePiece
  (`tokenizer.ggml.model = llama`) vocabulary built here from the corpus, with scores,
  byte-fallback tokens and control/user-defined tokens. The vocabulary is stored in the
  fixture and written to a metadata-only GGUF for llama-tokenize.

crates/engine/tests/tokenizer.rs checks Strata's tokenizer against both.

Each text is written to a file and passed with `-f` (bytes exactly as given), with
`--ids --log-disable --no-escape`; `--no-parse-special` is added for the cases whose
`parse_special` is false and `--no-bos` for those whose `add_special` is false.

Usage: tools/reference/tokenizer_fixture.py [--which all|smollm2|spm] [--model PATH]
       [--llama-tokenize PATH] [--out-dir DIR]
Model default: $STRATA_TEST_MODEL, else $STRATA_HOME/models/smollm2-135m-instruct.gguf
(STRATA_HOME defaults to ~/.cache/strata).
"""

import argparse
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHATML_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
)

# (text, parse_special)
CORPUS = [
    # ASCII prose and contractions
    ("Hello, world!", True),
    ("The quick brown fox jumps over the lazy dog.", True),
    ("I'm sure they'll say it's what we've done, isn't it? You'd think so.", True),
    ("DON'T SHOUT, YOU'LL WAKE THEM. I'M SERIOUS.", True),
    ("rock 'n' roll, the '90s, it\u2019s curly", True),
    ("Contact: John.Doe@Example.COM, CamelCaseIdentifier snake_case_name SCREAMING_CASE", True),
    ("https://example.com/path/to/page?query=1&b=two#fragment", True),
    # empty and whitespace
    ("", True),
    (" ", True),
    ("   leading and trailing spaces   ", True),
    ("multiple    spaces     between words", True),
    ("line one\nline two\n\nline four\n", True),
    ("\n\n\n", True),
    ("tabs\tand\t\tmore\ttabs\t", True),
    (" \t \n \r\n mixed whitespace \u00a0 no-break \u3000 ideographic", True),
    ("a\r\nb\r\n", True),
    ("end of line   \n   start of line", True),
    # digits and numbers
    ("0", True),
    ("1234567890", True),
    ("31415926535897932384626433832795028841971693993751", True),
    ("Pi is 3.14159265358979 and e is 2.71828.", True),
    ("Order #12345 costs $1,234.56 (tax 7.5%) on 2024-03-15 at 10:30.", True),
    ("-42 +17 1e10 0x1F 007 1_000_000", True),
    ("\uff11\uff12\uff13 \u0664\u0665 x\u00b2 \u00bd \u216b", True),
    # punctuation
    ("!!!???...,,,;;;:::", True),
    ("Quotes: \"double\" 'single' `backtick` \u00abguillemets\u00bb \u201ecurly\u201c \u2018single\u2019", True),
    ("Brackets ()[]{}<> and slashes / \\ | ~ ^ @ # % & * -- \u2014 \u2026", True),
    # code
    ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n", True),
    (
        "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n"
        "    println!(\"{:?}\", v);\n}\n",
        True,
    ),
    ("const add = (a, b) => a + b;\nconsole.log(`sum: ${add(1, 2)}`);\n", True),
    ("#include <stdio.h>\nint main(void) {\n\tprintf(\"hi\\n\");\n\treturn 0;\n}\n", True),
    ("<div class=\"x\"><p>Hello &amp; welcome</p></div>", True),
    ("{\"key\": [1, 2, {\"nested\": null}], \"ok\": true}", True),
    ("SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;", True),
    ("for f in *.txt; do echo \"$f\" | wc -l; done 2>/dev/null", True),
    ("# Title\n\n- item **bold** _italic_\n\n```python\nprint('x')\n```\n", True),
    # emoji
    ("I love pizza \U0001f355 and tacos \U0001f32e!", True),
    (
        "Family: \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466, flags: "
        "\U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5, skin tone: \U0001f44d\U0001f3fd, "
        "rainbow: \U0001f3f3\ufe0f\u200d\U0001f308",
        True,
    ),
    ("\U0001f600\U0001f603\U0001f604\U0001f601\U0001f606", True),
    # CJK
    ("\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002", True),
    ("\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u30ab\u30bf\u30ab\u30ca\u3001\u3072\u3089\u304c\u306a\u3002", True),
    ("\uc548\ub155\ud558\uc138\uc694, \ubc18\uac11\uc2b5\ub2c8\ub2e4.", True),
    # accented / Latin extended
    ("Caf\u00e9 na\u00efve r\u00e9sum\u00e9 co\u00f6perate fa\u00e7ade \u00c5ngstr\u00f6m", True),
    ("\u0141\u00f3d\u017a, Dvo\u0159\u00e1k, \u015ei\u015fli, \u00d0i\u00f0rik, \u0133, \u00df, \u0152uvre, \u01c5", True),
    ("e\u0301 a\u0308 n\u0303 (combining marks)", True),
    # other scripts
    ("\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u060c \u0643\u064a\u0641 \u062d\u0627\u0644\u0643\u061f", True),
    ("\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd! \u05de\u05d4 \u05e9\u05dc\u05d5\u05de\u05da?", True),
    ("\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u041a\u0430\u043a \u0434\u0435\u043b\u0430? \u0401\u0436\u0438\u043a \u0432 \u0442\u0443\u043c\u0430\u043d\u0435.", True),
    ("\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5, \u03b1\u03b2\u03b3\u03b4\u03b5 \u0391\u0392\u0393\u0394\u0395", True),
    ("\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e", True),
    ("\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01", True),
    ("\u2200x \u2208 \u211d: x\u00b2 \u2265 0 \u21d2 \u221a(x\u00b2) = |x| \u2248 \u221e \u00b1 \u2211\u222b", True),
    ("\U0001d518\U0001d52b\U0001d526\U0001d520\U0001d52c\U0001d521\U0001d522 \U0001d7d9\U0001d7da\U0001d7db \U00010348", True),
    ("bell\u0007 ctrl\u0001 escape \u001b[0m del\u007f", True),
    # special tokens
    (CHATML_PROMPT, True),
    (CHATML_PROMPT, False),
    ("<|im_start|><|im_end|><|endoftext|>text<|im_end|>\n", True),
    ("<|im_start|><|im_end|><|endoftext|>text<|im_end|>\n", False),
    ("<|im_start| not special <|im_end and <|unknown|> <im_start>", True),
    ("<|endoftext|>", True),
    ("a<|endoftext|>b", False),
    ("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", True),
]


def default_model() -> Path:
    env = os.environ.get("STRATA_TEST_MODEL")
    if env:
        return Path(env)
    home = os.environ.get("STRATA_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
    return Path(home) / "models" / "smollm2-135m-instruct.gguf"


def tokenize(binary: Path, model: Path, text: str, parse_special: bool, add_special: bool = True) -> list:
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    try:
        cmd = [str(binary), "-m", str(model), "-f", path, "--ids", "--log-disable", "--no-escape"]
        if not parse_special:
            cmd.append("--no-parse-special")
        if not add_special:
            cmd.append("--no-bos")
        proc = subprocess.run(cmd, capture_output=True, check=False)
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        raise RuntimeError(
            f"llama-tokenize failed ({proc.returncode}) for {text!r}: {proc.stderr.decode(errors='replace')}"
        )
    lines = [l for l in proc.stdout.decode("utf-8").splitlines() if l.startswith("[")]
    if not lines:
        raise RuntimeError(f"no ids in llama-tokenize output for {text!r}: {proc.stdout!r}")
    return json.loads(lines[-1])


# Extra strings for the SentencePiece vocabulary: dummy prefix, special tokens between
# text, byte fallback.
SPM_EXTRA = [
    ("Hello world", True),
    (" leading space", True),
    ("hello</s>world", True),
    ("hello</s>world", False),
    ("<s>hello", True),
    ("<|user|>hi there<|eot_id|>", False),
    ("<|user|>hi there<|eot_id|>", True),
    ("Byte fallback: \u20ac \U0001f600 \u4f60\u597d!", True),
    ("the the the there then they them their", True),
]

SPM_SPECIALS = [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<|user|>", 4), ("<|eot_id|>", 3)]


def build_spm_vocab() -> dict:
    """A deterministic SentencePiece-style vocabulary: control/user tokens, 256 byte
    tokens, then frequent corpus substrings (spaces as U+2581) with made-up scores.
    Pieces containing the euro sign or the grinning emoji are left out so those
    characters need byte fallback."""
    rng = random.Random(7)
    counts = Counter()
    for text, _ in CORPUS + SPM_EXTRA:
        s = "\u2581" + text.replace(" ", "\u2581")
        for i in range(len(s)):
            for n in range(1, 7):
                if i + n <= len(s):
                    counts[s[i : i + n]] += 1
    tokens, scores, types = [], [], []
    for text, ty in SPM_SPECIALS:
        tokens.append(text)
        scores.append(0.0)
        types.append(ty)
    for b in range(256):
        tokens.append("<0x%02X>" % b)
        scores.append(0.0)
        types.append(6)
    seen = set(tokens)
    for piece, count in counts.most_common(2500):
        if piece in seen or "\u20ac" in piece or "\U0001f600" in piece:
            continue
        seen.add(piece)
        tokens.append(piece)
        scores.append(round(math.log(count) - 0.5 * len(piece) - 3.0 * rng.random(), 4))
        types.append(1)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def write_vocab_gguf(path: Path, vocab: dict) -> None:
    """A GGUF v3 file with metadata only (no tensors): enough for llama-tokenize."""
    kv = [
        ("general.architecture", "s", "llama"),
        ("general.name", "s", "strata-synthetic-spm"),
        ("llama.context_length", "u32", 512),
        ("llama.embedding_length", "u32", 64),
        ("llama.block_count", "u32", 1),
        ("llama.feed_forward_length", "u32", 128),
        ("llama.attention.head_count", "u32", 4),
        ("llama.attention.head_count_kv", "u32", 4),
        ("llama.attention.layer_norm_rms_epsilon", "f32", 1e-5),
        ("llama.rope.dimension_count", "u32", 16),
        ("llama.vocab_size", "u32", len(vocab["tokenizer.ggml.tokens"])),
        ("tokenizer.ggml.model", "s", vocab["tokenizer.ggml.model"]),
        ("tokenizer.ggml.tokens", "as", vocab["tokenizer.ggml.tokens"]),
        ("tokenizer.ggml.scores", "af32", vocab["tokenizer.ggml.scores"]),
        ("tokenizer.ggml.token_type", "ai32", vocab["tokenizer.ggml.token_type"]),
        ("tokenizer.ggml.bos_token_id", "u32", vocab["tokenizer.ggml.bos_token_id"]),
        ("tokenizer.ggml.eos_token_id", "u32", vocab["tokenizer.ggml.eos_token_id"]),
        ("tokenizer.ggml.unknown_token_id", "u32", vocab["tokenizer.ggml.unknown_token_id"]),
    ]
    types = {"u32": (4, "<I"), "i32": (5, "<i"), "f32": (6, "<f"), "s": (8, None)}

    def put_str(f, text):
        raw = text.encode("utf-8")
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)

    def put_scalar(f, ty, value):
        if ty == "s":
            put_str(f, value)
        else:
            f.write(struct.pack(types[ty][1], value))

    with open(path, "wb") as f:
        f.write(b"GGUF")
        f.write(struct.pack("<IQQ", 3, 0, len(kv)))
        for key, ty, value in kv:
            put_str(f, key)
            if ty.startswith("a"):
                elem = ty[1:]
                f.write(struct.pack("<IIQ", 9, types[elem][0], len(value)))
                for item in value:
                    put_scalar(f, elem, item)
            else:
                f.write(struct.pack("<I", types[ty][0]))
                put_scalar(f, ty, value)
        f.write(b"\0" * ((-f.tell()) % 32))


def invocation(version: str) -> dict:
    return {
        "source": f"llama.cpp vendored in the llama-cpp-python {version} sdist, built by tools/llamacpp/build.sh",
        "invocation": "llama-tokenize -m MODEL -f TEXT_FILE --ids --log-disable --no-escape "
        "[--no-parse-special] [--no-bos]",
        "notes": "TEXT_FILE holds the text's UTF-8 bytes; --no-parse-special when parse_special "
        "is false; --no-bos when add_special is false (otherwise BOS per the model)",
    }


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--which", choices=["all", "smollm2", "spm"], default="all")
    ap.add_argument("--model", type=Path, default=default_model())
    ap.add_argument("--llama-tokenize", type=Path, default=ROOT / "target" / "llama.cpp" / "bin" / "llama-tokenize")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "crates" / "engine" / "tests" / "fixtures")
    args = ap.parse_args()

    binary = args.llama_tokenize
    if not binary.is_file():
        print(f"llama-tokenize not found: {binary} (run tools/llamacpp/build.sh)", file=sys.stderr)
        return 1
    version = "unknown"
    version_file = binary.parent.parent / "VERSION"
    if version_file.is_file():
        version = version_file.read_text().strip()

    if args.which in ("all", "smollm2"):
        if not args.model.is_file():
            print(f"model not found: {args.model}", file=sys.stderr)
            return 1
        cases = []
        for text, parse_special in CORPUS:
            ids = tokenize(binary, args.model, text, parse_special)
            cases.append({"text": text, "add_special": True, "parse_special": parse_special, "ids": ids})
        out = args.out_dir / "tokenizer_smollm2.json"
        write_json(out, {
            "model": args.model.name,
            "generator": "tools/reference/tokenizer_fixture.py",
            "llama_cpp": invocation(version),
            "cases": cases,
        })
        print(f"wrote {len(cases)} cases to {out}")

    if args.which in ("all", "spm"):
        vocab = build_spm_vocab()
        with tempfile.TemporaryDirectory() as tmp:
            gguf = Path(tmp) / "spm.gguf"
            write_vocab_gguf(gguf, vocab)
            cases = []
            for text, parse_special in CORPUS + SPM_EXTRA:
                for add_special in (True, False):
                    ids = tokenize(binary, gguf, text, parse_special, add_special)
                    cases.append({"text": text, "add_special": add_special,
                                  "parse_special": parse_special, "ids": ids})
        out = args.out_dir / "tokenizer_spm_synthetic.json"
        write_json(out, {
            "model": "synthetic SentencePiece vocabulary (build_spm_vocab in the generator)",
            "generator": "tools/reference/tokenizer_fixture.py",
            "llama_cpp": invocation(version),
            "vocab": vocab,
            "cases": cases,
        })
        print(f"wrote {len(cases)} cases to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
