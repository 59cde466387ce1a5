#!/usr/bin/env python3
"""Sentences per second: Strata's /v1/embeddings against sentence-transformers, same CPU.

Both sides embed the same MiniLM files (the directory `strata model pull all-minilm-l6-v2`
installs) with mean pooling and L2 normalisation, at batch 1 (one sentence per request /
encode call, one after another) and batch 32 (32 sentences per request / encode call).
The sides run interleaved, round by round (Strata b1, ST b1, Strata b32, ST b32, ...), so
background load on a shared machine hits both alike; each round records the 1-minute load
average. Strata is timed through HTTP on loopback (JSON encoding and decoding included);
sentence-transformers is timed in process (no HTTP at all), which favours it.

Needs: `pip install torch sentence-transformers` (the interpreter running this script),
a built `strata` binary (STRATA, default target/debug/strata: the engine and its kernels are
built at opt-level 3 in the dev profile too).

    python3 bench/embeddings_vs_st.py --rounds 5 [--weights f32,int8]

`--weights` starts one Strata engine per encoder weight format (`STRATA_EMBED_WEIGHTS`:
`int8`, the default, or `f32`) and interleaves them with sentence-transformers in every
round, so a before/after comparison shares the machine's conditions. With `STRATA_B` (a
second `strata` binary, the build before a change) each format also runs on it, labelled
`FORMAT@b`, in the same rounds.
"""

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

WORDS = (
    "the a of to and in is it that for on with as was by at be this from or an are have not "
    "model serving request token latency cache batch engine router replica vector sentence "
    "embedding search query document cluster network server memory thread kernel compute "
    "quick brown fox jumps over lazy dog river mountain city evening morning coffee music "
    "people language learning system data weather market history science garden window"
).split()


def sentences(n, seed=16):
    """`n` sentences of 6..40 words, the same every run."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(6, 40)
        out.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
    return out


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def load_avg():
    return os.getloadavg()[0]


class Strata:
    def __init__(self, exe, model, threads, weights):
        self.port = free_port()
        env = dict(os.environ)
        if threads:
            env["RAYON_NUM_THREADS"] = str(threads)
        env["STRATA_EMBED_WEIGHTS"] = weights
        self.weights = weights
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
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        self.name = model

    def embed(self, batch):
        body = json.dumps({"model": self.name, "input": batch, "encoding_format": "float"})
        self.conn.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise SystemExit(f"strata answered {r.status}: {data[:300]!r}")
        return [d["embedding"] for d in json.loads(data)["data"]]

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_side(embed, items, batch):
    """Sentences per second embedding `items` in chunks of `batch`, one after another."""
    t0 = time.perf_counter()
    for i in range(0, len(items), batch):
        embed(items[i : i + batch])
    return len(items) / (time.perf_counter() - t0)


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    na = sum(x * x for x in a) ** 0.5
    nb = sum(y * y for y in b) ** 0.5
    return dot / (na * nb)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--b1", type=int, default=64, help="sentences per batch-1 run")
    ap.add_argument("--b32", type=int, default=256, help="sentences per batch-32 run")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads each side uses")
    ap.add_argument("--model", default="all-minilm-l6-v2")
    ap.add_argument(
        "--weights", default="int8", help="Strata encoder weight formats, comma-separated"
    )
    args = ap.parse_args()

    exe = os.environ.get("STRATA", "target/debug/strata")
    model_dir = subprocess.run(
        [exe, "model", "path", args.model], check=True, capture_output=True, text=True
    ).stdout.strip()

    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    st = SentenceTransformer(model_dir, device="cpu")
    st_embed = lambda b: st.encode(b, batch_size=len(b), normalize_embeddings=True)

    formats = [w.strip() for w in args.weights.split(",") if w.strip()]
    sides = []
    try:
        for w in formats:
            sides.append(Strata(exe, args.model, args.threads, w))
        if os.environ.get("STRATA_B"):
            for w in list(formats):
                side = Strata(os.environ["STRATA_B"], args.model, args.threads, w)
                side.weights = f"{w}@b"
                sides.append(side)
                formats.append(side.weights)
        items = sentences(max(args.b1, args.b32))
        # Warm-up, and a check that both sides compute the same vectors.
        probe = items[:32]
        b = st_embed(probe)
        for side in sides:
            a = side.embed(probe)
            worst = min(cosine(x, list(map(float, y))) for x, y in zip(a, b))
            print(
                f"agreement ({side.weights}): min cosine {worst:.6f} over {len(probe)} sentences",
                flush=True,
            )
        rows = {(w, batch): [] for w in formats for batch in (1, 32)}
        st_rows = {1: [], 32: []}
        loads = []
        for r in range(args.rounds):
            for batch, n in ((1, args.b1), (32, args.b32)):
                got = {side.weights: run_side(side.embed, items[:n], batch) for side in sides}
                t = run_side(st_embed, items[:n], batch)
                st_rows[batch].append(t)
                for w, s in got.items():
                    rows[(w, batch)].append(s)
                loads.append(load_avg())
                line = "  ".join(f"strata {w} {s:8.1f}/s ({s / t:5.2f}x)" for w, s in got.items())
                print(
                    f"round {r + 1} batch {batch:2}: {line}  "
                    f"sentence-transformers {t:8.1f}/s  load {loads[-1]:.2f}",
                    flush=True,
                )
    finally:
        for side in sides:
            side.stop()

    print()
    print(
        "| weights | batch | Strata sentences/s | sentence-transformers sentences/s "
        "| ratio (target ≥ 2) |"
    )
    print("|---|---|---|---|---|")
    for w in formats:
        for batch in (1, 32):
            s, t = rows[(w, batch)], st_rows[batch]
            ratios = [x / y for x, y in zip(s, t)]
            print(
                f"| {w} | {batch} | {statistics.median(s):.1f} | {statistics.median(t):.1f} | "
                f"**{statistics.median(ratios):.2f}** "
                f"(rounds {min(ratios):.2f}–{max(ratios):.2f}) |"
            )
    print(
        f"\nmedians over {args.rounds} interleaved rounds; {args.threads} threads each; "
        f"1-min load average {min(loads):.2f}–{max(loads):.2f}; torch {torch.__version__}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
