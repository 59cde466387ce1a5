#!/usr/bin/env python3
"""Writes the tiny BERT sequence-classification models the engine's tests load, and the logits
transformers computes for them.

Usage: python3 tools/make_tiny_bert.py [OUT_DIR]   (default tests/fixtures/tiny-bert)

OUT_DIR gets two model directories, each `config.json` + `model.safetensors` (f16 weights) +
`tokenizer.json` (a 73-entry WordPiece vocabulary, lower-cased, BERT's pair template):
- `cross-encoder/`: `BertForSequenceClassification` with one label (a cross-encoder);
- `classifier/`: the same shape with three labels, `id2label` {0: safe, 1: toxic, 2: spam};
and `expected.json`: for fixed texts and (query, document) pairs, transformers' token ids,
token type ids and float32 logits (the f16 weights read back as float32, so both sides compute
from the same numbers). Shape: hidden 32, 2 layers of 2 heads, feed-forward 64, 64 positions,
so the engine's 8-bit path (whole blocks of 32) runs on it too.

Needs torch and transformers (`pip install torch transformers`); the tests themselves need
neither: the directory is committed. The weights are random with a fixed seed and every
parameter (LayerNorms included) perturbed, so that a wrongly loaded tensor changes the logits.
"""

import json
import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

WORDS = (
    "the a of to and in is it that for on with as was by at be this from or an are "
    "model serving request token cache batch engine query document search vector city "
    "river mountain coffee music people language weather market garden window night "
    "buy free money click now win prize hate stupid kill love good bad great quick brown "
    "fox dog jumps over lazy"
).split()
assert len(WORDS) == 66 and len(set(WORDS)) == 66, len(WORDS)
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + ["##s", "##ing"]

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "buy now and win a free prize",
    "I hate this stupid model",
    "a good coffee in the city at night",
    "search the document cache for a query vector",
    "Weather and market",
    "searching models, unknown words!",
]
PAIRS = [
    ("search engine", "the engine serving a search query"),
    ("search engine", "coffee and music in the garden"),
    ("coffee", "a great coffee in the city"),
    ("river mountain", "the weather at night is bad"),
    ("quick fox", "the quick brown fox jumps over the lazy dog"),
]


def tokenizer(out):
    """BERT's WordPiece pipeline over VOCAB, saved as tokenizer.json, and transformers'
    tokenizer reading that same file."""
    os.makedirs(out, exist_ok=True)
    t = Tokenizer(models.WordPiece({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    t.normalizer = normalizers.BertNormalizer(lowercase=True)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", VOCAB.index("[CLS]")), ("[SEP]", VOCAB.index("[SEP]"))],
    )
    t.decoder = decoders.WordPiece()
    t.add_special_tokens(VOCAB[:5])
    path = os.path.join(out, "tokenizer.json")
    t.save(path)
    return BertTokenizerFast(
        tokenizer_file=path,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
    )


def model(out, labels, seed):
    config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_act="gelu",
        initializer_range=0.2,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    config.architectures = ["BertForSequenceClassification"]
    torch.manual_seed(seed)
    m = BertForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.add_(0.1 * torch.randn_like(p))
    m.half().save_pretrained(out, safe_serialization=True)
    return BertForSequenceClassification.from_pretrained(out, torch_dtype=torch.float32).eval()


def run(m, tok, texts, pairs=None):
    if pairs is None:
        enc = tok(texts, padding=True, return_tensors="pt")
    else:
        enc = tok([q for q, _ in pairs], [d for _, d in pairs], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = m(**enc).logits
    rows = []
    for i in range(logits.shape[0]):
        n = int(enc["attention_mask"][i].sum())
        row = {
            "input_ids": enc["input_ids"][i][:n].tolist(),
            "token_type_ids": enc["token_type_ids"][i][:n].tolist(),
            "logits": [float(x) for x in logits[i]],
        }
        if pairs is None:
            row["text"] = texts[i]
        else:
            row["query"], row["document"] = pairs[i]
        rows.append(row)
    return rows


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/tiny-bert"
    expected = {"generator": "tools/make_tiny_bert.py", "torch": torch.__version__}
    for kind, labels, seed in (
        ("cross-encoder", ["LABEL_0"], 55),
        ("classifier", ["safe", "toxic", "spam"], 69),
    ):
        out = os.path.join(root, kind)
        tok = tokenizer(out)
        m = model(out, labels, seed)
        expected[kind] = {"texts": run(m, tok, TEXTS), "pairs": run(m, tok, None, PAIRS)}
    with open(os.path.join(root, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print("wrote", root)


if __name__ == "__main__":
    main()
