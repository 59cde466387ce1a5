"""Multi-LoRA throughput: mixed traffic over 4 adapters and the base model against
base-only traffic, on one Strata engine, plus the runtime adapter load time.

Usage:
  python3 bench/lora_mixed.py STRATA_BINARY [--streams 16] [--rounds 3] [--requests 3]
      [--tokens 64] [--rank 8] [--targets q_proj,...] [--port 8791]

Writes 5 seeded adapters with tools/make_lora_adapter.py into a temporary directory,
starts `strata engine --enable-lora --max-loras 4 --lora-modules a0=... a3=...` on
127.0.0.1, then runs the two workloads interleaved (base, mixed, base, mixed, ...) so
that machine noise hits both alike: STREAMS concurrent streams, each sending REQUESTS
completions of TOKENS tokens (ignore_eos, greedy, distinct random-word prompts so the
prefix cache does not help either side). In the mixed workload request i goes to
[base, a0, a1, a2, a3][i % 5]. Then it loads and unloads a fifth adapter 5 times over
HTTP. Prints one JSON line per round and a summary line with the ratio of mixed to base
output tok/s (median of rounds) and the median load time, and the load average.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "smollm2-135m-instruct"
WORDS = "apple river stone window quiet orange market seven lantern piano garden cloud".split()


def post(url, body, timeout=600):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def wait_ready(base, proc, limit=300):
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the engine exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    sys.exit("the engine did not become ready")


def run_round(base, models, streams, per_stream, tokens, seed):
    rng = random.Random(seed)
    prompts = [
        " ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(streams * per_stream)
    ]
    out_tokens = [0] * streams
    errors = []

    def stream(s):
        for k in range(per_stream):
            i = s * per_stream + k
            body = {
                "model": models[i % len(models)],
                "prompt": prompts[i],
                "max_tokens": tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            try:
                _, text = post(base + "/v1/completions", body)
                out_tokens[s] += json.loads(text)["usage"]["completion_tokens"]
            except Exception as e:  # noqa: BLE001 - reported, the round is invalid
                errors.append(repr(e))

    threads = [threading.Thread(target=stream, args=(s,)) for s in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    if errors:
        sys.exit(f"requests failed: {errors[:3]}")
    total = sum(out_tokens)
    return {"output_tokens": total, "seconds": round(secs, 3), "tok_s": round(total / secs, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("strata")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=3, help="requests per stream per round")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument(
        "--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )
    p.add_argument("--port", type=int, default=8791)
    args = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="strata-lora-bench-")
    paths = []
    for i in range(5):
        d = os.path.join(tmp, f"a{i}")
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools/make_lora_adapter.py"), d,
             "--rank", str(args.rank), "--alpha", str(2 * args.rank), "--seed", str(i),
             "--targets", args.targets],
            check=True, stdout=subprocess.DEVNULL,
        )
        paths.append(d)
    base = f"http://127.0.0.1:{args.port}"
    cmd = [
        args.strata, "engine", "--port", str(args.port), "--enable-lora",
        "--max-loras", "4", "--max-lora-rank", str(max(16, args.rank)), "--max-cpu-loras", "5",
        "--lora-modules", *[f"a{i}={paths[i]}" for i in range(4)],
        # a4 is loaded at run time, which the engine allows only under --lora-dir.
        "--lora-dir", os.path.dirname(paths[4]),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(base, proc)
        # Warm-up: every adapter and the base once.
        run_round(base, [MODEL, "a0", "a1", "a2", "a3"], 5, 1, 8, 999)
        results = {"base": [], "mixed": []}
        for r in range(args.rounds):
            for name, models in (("base", [MODEL]), ("mixed", [MODEL, "a0", "a1", "a2", "a3"])):
                res = run_round(base, models, args.streams, args.requests, args.tokens, r)
                res.update(round=r, workload=name, loadavg=os.getloadavg()[0])
                results[name].append(res["tok_s"])
                print(json.dumps(res), flush=True)
        loads = []
        for _ in range(5):
            t0 = time.perf_counter()
            post(base + "/v1/load_lora_adapter", {"lora_name": "a4", "lora_path": paths[4]})
            loads.append((time.perf_counter() - t0) * 1e3)
            post(base + "/v1/unload_lora_adapter", {"lora_name": "a4"})
        b, m = statistics.median(results["base"]), statistics.median(results["mixed"])
        print(json.dumps({
            "summary": True, "streams": args.streams, "rank": args.rank,
            "targets": args.targets, "tokens": args.tokens,
            "base_tok_s": b, "mixed_tok_s": m, "ratio": round(m / b, 3),
            "adapter_load_ms_median": round(statistics.median(loads), 1),
            "loadavg": os.getloadavg(),
        }), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
