#!/usr/bin/env python3
"""Autoscaling under `strata up`, live: a load ramp from 1 to 16 concurrent streams and back,
run three times on this machine — Strata's autoscaler (min 1 / max 3), a fixed 3-replica
deployment, and the HPA-style threshold policy (`autoscale.policy: threshold`, min 1 / max 3).

For each: replicas (ready), queue depth (requests waiting in the engines) and TTFT p90 (the
dashboard's 10 s window) are sampled every second from `strata up`'s `/ui/api/state`; the
load is `strata bench` phases of fixed concurrency. Printed: TTFT p90 over every request of
the run, replica-seconds (replicas alive, starting ones included, integrated over the run),
and output tokens. Written: target/autoscale-ramp/{NAME}.csv, summary.json and a PNG plot
(docs/img/autoscale-ramp.png with --doc).

    python3 bench/autoscale_ramp.py [--phase-secs 30] [--doc]

Needs: target/release/strata (or $STRATA; built unless SKIP_BUILD=1), the default model
(pulled by `strata up`), and matplotlib (installed into target/plot-venv on first run).
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "target", "autoscale-ramp")
STRATA = os.environ.get("STRATA") or os.path.join(ROOT, "target", "release", "strata")
LEVELS = [1, 2, 4, 8, 16, 16, 8, 4, 2, 1]

ENGINE_ARGS = ["--max-num-seqs", "8"]


def yaml_list(xs):
    return "[" + ", ".join(json.dumps(x) for x in xs) + "]"


def configs(phase_secs):
    common = (
        "gateway: false\n"
        f"engine_args: {yaml_list(ENGINE_ARGS)}\n"
    )
    # The scale-in delays are shortened alike for both policies so that a 5-minute ramp can
    # show scale-in at all (the defaults are minutes).
    return {
        "strata": common
        + "autoscale:\n"
        "  minReplicas: 1\n"
        "  maxReplicas: 3\n"
        "  targetConcurrency: 6\n"
        "  targetQueueDepth: 2\n"
        "  stableWindowSecs: 30\n"
        "  panicWindowSecs: 6\n"
        "  scaleInCooldownSecs: 20\n"
        "  coldStartSecs: 5\n",
        "fixed-3": common + "replicas: 3\n",
        "threshold": common
        + "autoscale:\n"
        "  policy: threshold\n"
        "  minReplicas: 1\n"
        "  maxReplicas: 3\n"
        "  threshold:\n"
        "    utilization: 0.7\n"
        "    slots: 8\n"
        "    periodSecs: 15\n"
        "    scaleInStabilizationSecs: 30\n",
    }


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def get_json(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(url, proc, secs=600):
    end = time.time() + secs
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"strata up exited with {proc.returncode}")
        try:
            st = get_json(url + "/ui/api/state")
            if any(r.get("ready") for r in st.get("replicas", [])):
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError("no ready replica in time")


def last(xs):
    for x in reversed(xs or []):
        if x is not None:
            return x
    return None


class Sampler(threading.Thread):
    def __init__(self, url):
        super().__init__(daemon=True)
        self.url = url
        self.rows = []
        self.stop = threading.Event()
        self.t0 = time.time()

    def run(self):
        while not self.stop.is_set():
            t = time.time() - self.t0
            try:
                st = get_json(self.url + "/ui/api/state", timeout=1.0)
                reps = st.get("replicas", [])
                ready = sum(1 for r in reps if r.get("ready"))
                alive = len(reps)
                waiting = sum((r.get("waiting") or 0.0) for r in reps)
                ttft = last(st.get("series", {}).get("ttft_p90"))
                self.rows.append((t, ready, alive, waiting, ttft))
            except Exception:
                pass
            self.stop.wait(1.0)


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_one(name, yaml_text, phase_secs):
    port = free_port()
    cfg = os.path.join(OUT, f"{name}.yaml")
    with open(cfg, "w") as f:
        f.write(yaml_text + f"port: {port}\n")
    log = open(os.path.join(OUT, f"{name}.up.log"), "w")
    proc = subprocess.Popen(
        [STRATA, "up", "--config", cfg], stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        sampler = Sampler(url)
        sampler.start()
        for i, c in enumerate(LEVELS):
            rep = os.path.join(OUT, f"{name}.phase{i}.json")
            subprocess.run(
                [STRATA, "bench", "--url", url, "--workload", "random", "--input-len", "128",
                 "--output-len", "32", "--concurrency", str(c), "--duration", f"{phase_secs}s",
                 "--seed", str(100 + i), "--quiet", "--output", rep],
                check=True, stdout=subprocess.DEVNULL,
            )
        # Let scale-in show after the load ends.
        time.sleep(phase_secs)
        sampler.stop.set()
        sampler.join()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    with open(os.path.join(OUT, f"{name}.csv"), "w") as f:
        f.write("t,ready,alive,waiting,ttft_p90_s\n")
        for r in sampler.rows:
            f.write(",".join("" if v is None else f"{v:.3f}" for v in r) + "\n")
    with open(os.path.join(OUT, f"{name}.meta.json"), "w") as f:
        json.dump({"t0_unix": sampler.t0, "phases": len(LEVELS)}, f)
    return collect(name)


def collect(name):
    """One run's results from its files: the sampled CSV and each phase's bench report."""
    rows = []
    with open(os.path.join(OUT, f"{name}.csv")) as f:
        next(f)
        for line in f:
            v = line.strip().split(",")
            rows.append((float(v[0]), int(float(v[1])), int(float(v[2])), float(v[3]),
                         float(v[4]) if v[4] else None))
    reports = []
    for i in range(len(LEVELS)):
        with open(os.path.join(OUT, f"{name}.phase{i}.json")) as f:
            reports.append(json.load(f))
    meta_path = os.path.join(OUT, f"{name}.meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            t0 = json.load(f)["t0_unix"]
    else:
        t0 = reports[0]["started_at_unix_s"]
    lines, phases = [], []
    for c, r in zip(LEVELS, reports):
        started = r["started_at_unix_s"] - t0
        phases.append((started, c))
        for l in r["request_lines"]:
            lines.append((started + l["start_s"], l))
    ttfts = [l["ttft_ms"] for _, l in lines if l.get("ttft_ms") is not None and not l.get("error")]
    replica_seconds = sum(
        rows[i][2] * (rows[i + 1][0] - rows[i][0]) for i in range(len(rows) - 1)
    )
    return {
        "name": name,
        "requests": len(lines),
        "failed": sum(1 for _, l in lines if l.get("error")),
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p90_ms": percentile(ttfts, 0.9),
        "output_tokens": sum(l["output_tokens"] for _, l in lines),
        "replica_seconds": replica_seconds,
        "duration_s": rows[-1][0] - rows[0][0] if rows else 0,
        "phases": phases,
        "rows": rows,
    }


def plot(results, path):
    venv = os.path.join(ROOT, "target", "plot-venv")
    py = os.path.join(venv, "bin", "python3")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "matplotlib"], check=True)
    data = os.path.join(OUT, "plot-data.json")
    with open(data, "w") as f:
        json.dump(results, f)
    code = r'''
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
res = json.load(open(sys.argv[1]))
fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
colors = {"strata": "tab:blue", "fixed-3": "tab:gray", "threshold": "tab:orange"}
for r in res:
    t = [x[0] for x in r["rows"]]
    c = colors.get(r["name"], None)
    axes[1].step(t, [x[1] for x in r["rows"]], where="post", label=r["name"], color=c)
    axes[2].plot(t, [x[3] for x in r["rows"]], label=r["name"], color=c)
    axes[3].plot(t, [x[4] if x[4] is not None else float("nan") for x in r["rows"]],
                 label=r["name"], color=c)
ph = res[0]["phases"]
ts, cs = [], []
for (s, c) in ph:
    ts.append(s); cs.append(c)
axes[0].step(ts, cs, where="post", color="black")
axes[0].set_ylabel("concurrent streams")
axes[1].set_ylabel("ready replicas")
axes[2].set_ylabel("queue depth (waiting)")
axes[3].set_ylabel("TTFT p90 (s, 10 s window)")
axes[3].set_xlabel("seconds")
for a in axes[1:]:
    a.legend(loc="upper right")
axes[0].set_title("strata up: 1 -> 16 -> 1 streams, min 1 / max 3 replicas")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=90)
'''
    subprocess.run([py, "-c", code, data, path], check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase-secs", type=int, default=30)
    ap.add_argument("--only", default=None, help="comma-separated subset of strata,fixed-3,threshold")
    ap.add_argument("--doc", action="store_true", help="write the plot to docs/img/")
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if os.environ.get("SKIP_BUILD") != "1":
        subprocess.run(["cargo", "build", "-q", "--release", "-p", "strata-cli"], cwd=ROOT, check=True)
    cfgs = configs(a.phase_secs)
    names = a.only.split(",") if a.only else list(cfgs)
    results = []
    for n in cfgs:
        if n in names:
            print(f"== {n}", file=sys.stderr, flush=True)
            results.append(run_one(n, cfgs[n], a.phase_secs))
        elif os.path.exists(os.path.join(OUT, f"{n}.csv")):
            # --only re-runs some; the others come from their last run's files.
            print(f"== {n}: from its last run's files", file=sys.stderr)
            results.append(collect(n))
    with open(os.path.join(OUT, "summary.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "rows"} for r in results], f, indent=1)
    base = next((r for r in results if r["name"] == "fixed-3"), None)
    print("| policy | requests (failed) | TTFT p50 | TTFT p90 | output tokens | replica-seconds | vs fixed 3 |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['replica_seconds'] / base['replica_seconds']:.2f}" if base else "-"
        print(f"| {r['name']} | {r['requests']} ({r['failed']}) | {r['ttft_p50_ms'] / 1000:.2f} s "
              f"| {r['ttft_p90_ms'] / 1000:.2f} s | {r['output_tokens']} | {r['replica_seconds']:.0f} | {ratio} |")
    path = os.path.join(ROOT, "docs", "img", "autoscale-ramp.png") if a.doc else os.path.join(OUT, "autoscale-ramp.png")
    plot(results, path)
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
