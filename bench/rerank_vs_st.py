#!/usr/bin/env python3
"""Documents reranked per second: Strata's /rerank against sentence-transformers, one thread each.

Two comparisons, each side scoring the same (query, 32 documents) requests one after another:
- bi-encoder: Strata serving all-MiniLM-L6-v2 (`/rerank` scores by cosine similarity) against
  `SentenceTransformer(...).encode` of the query and the documents plus `util.cos_sim`;
- cross-encoder: Strata serving a `BertForSequenceClassification` with one label against
  `CrossEncoder(...).predict` on the same files. No cross-encoder ships in any registry here, so
  the script writes one with random weights (`--ce-shape tiny`: the test fixture's shape, hidden
  32 and 2 layers; `minilm`: ms-marco-MiniLM-L-6-v2's shape, hidden 384, 6 layers, 12 heads,
  a 30,522-word vocabulary from the MiniLM tokenizer).

Strata runs with RAYON_NUM_THREADS=1 and is timed through HTTP on loopback (JSON included);
sentence-transformers runs in process with torch.set_num_threads(1), which favours it. The sides
run interleaved, round by round, and the first request of each is checked to agree.

Needs: `pip install torch sentence-transformers` (the interpreter running this script), a built
`strata` binary (STRATA, default target/debug/strata) and the MiniLM model
(`strata model pull all-minilm-l6-v2`).

    python3 bench/rerank_vs_st.py --rounds 5 [--ce-shape tiny|minilm|both]
"""

import argparse
import http.client
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

WORDS = (
    "the a of to and in is it that for on with as was by at be this from or an are have not "
    "model serving request token latency cache batch engine router replica vector sentence "
    "embedding search query document cluster network server memory thread kernel compute "
    "quick brown fox jumps over lazy dog river mountain city evening morning coffee music "
    "people language learning system data weather market history science garden window"
).split()


def text(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def requests(n, docs, seed=55):
    """`n` (query, documents) requests: queries of 4..12 words, documents of 20..60."""
    rng = random.Random(seed)
    return [(text(rng, 4, 12), [text(rng, 20, 60) for _ in range(docs)]) for _ in range(n)]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Strata:
    """`strata engine` serving `model` on a loopback port, one rayon thread."""

    def __init__(self, exe, model, weights):
        self.port = free_port()
        env = dict(os.environ, RAYON_NUM_THREADS="1", STRATA_EMBED_WEIGHTS=weights)
        self.proc = subprocess.Popen(
            [exe, "engine", "--model", model, "--port", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.time() + 120
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or self.proc.poll() is not None:
                raise SystemExit("strata engine did not become ready")
            time.sleep(0.2)
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)

    def scores(self, query, docs):
        """Relevance of each document, in the documents' order."""
        # Pairs past the model's length are cut to it (longest text first), as CrossEncoder
        # cuts them at its max_length: the tiny shape takes 64 tokens.
        body = json.dumps({"query": query, "documents": docs, "return_documents": False,
                           "truncate_prompt_tokens": -1})
        self.conn.request("POST", "/rerank", body, {"content-type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise SystemExit(f"strata answered {r.status}: {data[:300]!r}")
        out = [0.0] * len(docs)
        for res in json.loads(data)["results"]:
            out[res["index"]] = res["relevance_score"]
        return out

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def write_cross_encoder(shape, minilm_dir, out):
    """A random `BertForSequenceClassification` with one label, saved with a tokenizer.json."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    if shape == "tiny":
        src = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "tiny-bert", "cross-encoder")
        shutil.copytree(src, out, dirs_exist_ok=True)
        return
    cfg = BertConfig.from_pretrained(minilm_dir)
    cfg.architectures = ["BertForSequenceClassification"]
    cfg.num_labels = 1
    torch.manual_seed(55)
    BertForSequenceClassification(cfg).eval().save_pretrained(out, safe_serialization=True)
    shutil.copy(os.path.join(minilm_dir, "tokenizer.json"), out)
    for name in ("tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if os.path.exists(os.path.join(minilm_dir, name)):
            shutil.copy(os.path.join(minilm_dir, name), out)


def run_side(score, reqs):
    """Documents per second scoring `reqs` one after another."""
    t0 = time.perf_counter()
    n = 0
    for q, docs in reqs:
        score(q, docs)
        n += len(docs)
    return n / (time.perf_counter() - t0)


def compare(label, strata, reference, reqs, rounds, loads, tolerance):
    a, b = strata.scores(*reqs[0]), reference(*reqs[0])
    worst = max(abs(x - float(y)) for x, y in zip(a, b))
    print(f"{label}: agreement on the first request: max |score difference| {worst:.2e}", flush=True)
    if worst > tolerance:
        raise SystemExit(f"{label}: the sides disagree ({worst} > {tolerance})")
    ratios, s_rates, r_rates = [], [], []
    for r in range(rounds):
        s = run_side(strata.scores, reqs)
        t = run_side(reference, reqs)
        s_rates.append(s)
        r_rates.append(t)
        ratios.append(s / t)
        loads.append(os.getloadavg()[0])
        print(
            f"{label} round {r + 1}: strata {s:8.1f} docs/s  sentence-transformers {t:8.1f} docs/s "
            f"({s / t:5.2f}x)  load {loads[-1]:.2f}",
            flush=True,
        )
    return (statistics.median(s_rates), statistics.median(r_rates), statistics.median(ratios),
            min(ratios), max(ratios))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16, help="requests per round")
    ap.add_argument("--docs", type=int, default=32, help="documents per request")
    ap.add_argument("--ce-shape", default="both", choices=["tiny", "minilm", "both"])
    ap.add_argument("--weights", default="int8", help="Strata's encoder weights (int8 or f32)")
    args = ap.parse_args()

    exe = os.environ.get("STRATA", "target/debug/strata")
    minilm = subprocess.run(
        [exe, "model", "path", "all-minilm-l6-v2"], check=True, capture_output=True, text=True
    ).stdout.strip()

    import torch
    from sentence_transformers import CrossEncoder, SentenceTransformer, util

    torch.set_num_threads(1)
    reqs = requests(args.requests, args.docs)
    rows, loads = [], []

    st = SentenceTransformer(minilm, device="cpu")

    def st_scores(q, docs):
        e = st.encode([q] + docs, batch_size=len(docs) + 1, convert_to_tensor=True, normalize_embeddings=True)
        return util.cos_sim(e[0:1], e[1:])[0].tolist()

    side = Strata(exe, minilm, args.weights)
    try:
        rows.append(("bi-encoder, all-MiniLM-L6-v2",) + compare(
            "bi-encoder", side, st_scores, reqs, args.rounds, loads, 0.02))
    finally:
        side.stop()

    shapes = ["tiny", "minilm"] if args.ce_shape == "both" else [args.ce_shape]
    for shape in shapes:
        tmp = tempfile.mkdtemp(prefix=f"strata-ce-{shape}-")
        try:
            write_cross_encoder(shape, minilm, tmp)
            with open(os.path.join(tmp, "config.json")) as f:
                max_len = json.load(f)["max_position_embeddings"]
            # f32 as Strata computes (the fixture's config says float16, which torch would
            # run far slower on the CPU), cut at the model's length as Strata cuts.
            ce = CrossEncoder(tmp, device="cpu", num_labels=1, max_length=max_len,
                              model_kwargs={"dtype": torch.float32})

            def ce_scores(q, docs, ce=ce):
                return ce.predict([(q, d) for d in docs], batch_size=len(docs)).tolist()

            side = Strata(exe, tmp, args.weights)
            try:
                rows.append((f"cross-encoder, {shape} shape",) + compare(
                    f"cross-encoder ({shape})", side, ce_scores, reqs, args.rounds, loads, 0.05))
            finally:
                side.stop()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    print()
    print("| model | Strata docs/s | sentence-transformers docs/s | ratio (target ≥ 2) |")
    print("|---|---|---|---|")
    for name, s, t, ratio, lo, hi in rows:
        print(f"| {name} | {s:.1f} | {t:.1f} | **{ratio:.2f}** (rounds {lo:.2f}–{hi:.2f}) |")
    print(
        f"\nmedians over {args.rounds} interleaved rounds of {args.requests} requests x {args.docs} "
        f"documents; one thread each; Strata weights {args.weights}; 1-min load average "
        f"{min(loads):.2f}–{max(loads):.2f}; torch {torch.__version__}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
