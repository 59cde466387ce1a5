# Prints strata bench and guidellm numbers side by side, from their JSON outputs.
# Both tools' per-request data are summarized with the same percentile definition
# (numpy's linear), and rates are completed requests / wall time for both.
# usage: python3 table.py TAG   (run where out/ holds run.sh's files)
import json, sys, glob, statistics

def pct(xs, p):
    xs = sorted(xs)
    if not xs: return float('nan')
    h = p / 100 * (len(xs) - 1); lo = int(h); hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])

def strata(path):
    r = json.load(open(path)); l = r['latency_ms']
    return dict(ttft_mean=l['ttft']['mean'], ttft_p50=l['ttft']['p50'], ttft_p90=l['ttft']['p90'],
                tpot_mean=l['tpot']['mean'], itl_mean=l['itl']['mean'],
                e2e_mean=l['e2e']['mean'], e2e_p90=l['e2e']['p90'],
                req_s=r['throughput']['requests_per_s'], out_tok_s=r['throughput']['output_tokens_per_s'],
                ok=r['requests']['completed'], in_tok=r['tokens']['input_mean'], out_tok=r['tokens']['output_mean'])

def guidellm(path):
    d = json.load(open(path)); b = d['benchmarks'][0]; reqs = b['requests']['successful']
    ttft = [q['time_to_first_token_ms'] for q in reqs]
    e2e = [q['request_latency'] * 1000 for q in reqs]
    itl = [q['inter_token_latency_ms'] for q in reqs if q['inter_token_latency_ms'] is not None]
    st = b['scheduler_state']
    wall = st['end_requests_time'] - st['start_requests_time']
    out = sum(q['output_tokens'] or 0 for q in reqs)
    m = b['metrics']
    return dict(ttft_mean=statistics.mean(ttft), ttft_p50=pct(ttft, 50), ttft_p90=pct(ttft, 90),
                tpot_mean=statistics.mean(itl), itl_mean=m['inter_token_latency_ms']['successful']['mean'],
                e2e_mean=statistics.mean(e2e), e2e_p90=pct(e2e, 90),
                req_s=len(reqs) / wall, out_tok_s=out / wall, ok=len(reqs),
                in_tok=statistics.mean(q['prompt_tokens'] for q in reqs), out_tok=out / len(reqs),
                own_ttft_p50=m['time_to_first_token_ms']['successful']['percentiles']['p50'],
                own_req_s=m['requests_per_second']['successful']['mean'])

def fmt(k, x):
    return f"{x:.2f}" if k == "req_s" else (f"{x:.1f}" if isinstance(x, float) else str(x))

tag = sys.argv[1]
rows = []
for f in sorted(glob.glob(f'out/strata-{tag}-*.json')): rows.append(('strata bench', f, strata(f)))
for f in sorted(glob.glob(f'out/guidellm-{tag}-*.json')): rows.append(('guidellm', f, guidellm(f)))
keys = ['ok', 'in_tok', 'out_tok', 'ttft_mean', 'ttft_p50', 'ttft_p90', 'tpot_mean', 'e2e_mean', 'e2e_p90', 'req_s', 'out_tok_s']
print('| tool | run | ' + ' | '.join(keys) + ' |')
print('|---|---|' + '---|' * len(keys))
for tool, f, v in rows:
    print(f'| {tool} | {f.split("-")[-1][:-5]} | ' + ' | '.join(fmt(k, v[k]) for k in keys) + ' |')
for tool in ['strata bench', 'guidellm']:
    vs = [v for t, _, v in rows if t == tool]
    if vs:
        print(f'| {tool} | median | ' + ' | '.join(fmt(k, statistics.median(v[k] for v in vs)) for k in keys) + ' |')
