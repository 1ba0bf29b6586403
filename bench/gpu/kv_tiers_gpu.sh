#!/usr/bin/env bash
# The host-memory KV tier on a real GPU (issue 42): NOT run in this repository's CI
# (vLLM's offloading does not start on its CPU backend). One H100/H200-class GPU, vLLM
# 0.32 (CUDA build) and kubellm installed in the same Python; the model's weights local or
# reachable (MODEL, default Qwen/Qwen2.5-7B-Instruct; set HF_HUB_OFFLINE=1 with a local copy).
#
# What it runs: `kubellm engine` (the launcher, so the flags are the operator's) twice on
# the same GPU, without and with spec.engine.kvOffload (HOST_GIB of host memory), each
# with a KV pool shrunk to POOL_GIB via --kv-cache-memory-bytes so a few sessions overflow
# it; the same multi-turn sessions against each (every turn resends the whole history);
# then prints TTFT p50/p90 and vLLM's own counters: vllm:prefix_cache_hits_total (GPU),
# vllm:external_prefix_cache_hits_total (the tier) and vllm:kv_offload_load_bytes_total.
# Expect: with the tier, external hits > 0 and a lower TTFT p90 once the sessions'
# histories exceed the pool. Budget: ~10 minutes (two engine starts, ~3 min of load each).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
HOST_GIB=${HOST_GIB:-64}
POOL_GIB=${POOL_GIB:-4}
SESSIONS=${SESSIONS:-24}
TURNS=${TURNS:-6}
PORT=${PORT:-8123}
PY=${PY:-python}
OUT=${OUT:-/tmp/kv_tiers_gpu}
mkdir -p "$OUT"

spec() {  # $1: kvOffload JSON or empty
  local offload=""
  [ -n "$1" ] && offload=", \"kvOffload\": $1"
  cat > "$OUT/spec.json" <<JSON
{"model": {"source": "hf://$MODEL", "servedName": "m"},
 "engine": {"maxModelLen": 32768, "gpuMemoryUtilization": 0.9,
            "extraArgs": ["--kv-cache-memory-bytes", "$((POOL_GIB * 1024 * 1024 * 1024))"]$offload},
 "resources": {"gpu": {"count": 1}}}
JSON
}

run_one() {  # $1: label, $2: kvOffload JSON or empty
  spec "$2"
  kubellm engine --spec "$OUT/spec.json" --port "$PORT" --host 127.0.0.1 > "$OUT/$1.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 "$pid" 2> /dev/null || { tail -50 "$OUT/$1.log"; return 1; }
    sleep 1
  done
  grep -E -- "--kv-offloading|OffloadingConnector" "$OUT/$1.log" | head -3 || true
  "$PY" - "$1" "$PORT" "$SESSIONS" "$TURNS" "$OUT" <<'PYEOF'
import json, random, statistics, sys, time, concurrent.futures as cf
import httpx
label, port, sessions, turns, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
url = f"http://127.0.0.1:{port}"
rng = random.Random(0)
words = [f"w{i}" for i in range(5000)]
def text(n): return " ".join(rng.choice(words) for _ in range(n))
histories = [[{"role": "system", "content": text(3000)}] for _ in range(sessions)]
ttfts = []
with httpx.Client(timeout=600) as client:
    def turn(h):
        h.append({"role": "user", "content": text(600)})
        start = time.perf_counter(); first = None; answer = []
        with client.stream("POST", f"{url}/v1/chat/completions", json={"model": "m", "messages": h,
                           "max_tokens": 64, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if first is None: first = time.perf_counter() - start
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    answer.append(delta)
        h.append({"role": "assistant", "content": "".join(answer)})
        return first
    for t in range(turns):  # every session takes a turn, 4 at a time, round after round
        with cf.ThreadPoolExecutor(4) as pool:
            ttfts += [x for x in pool.map(turn, histories) if x is not None]
    metrics = client.get(f"{url}/metrics").text
keep = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total", "vllm:kv_offload_load_bytes_total",
        "vllm:kv_offload_store_bytes_total")
counters = {l.split("{")[0]: float(l.rsplit(" ", 1)[1]) for l in metrics.splitlines()
            if l.startswith(keep)}
q = statistics.quantiles(ttfts, n=10)
row = {"label": label, "requests": len(ttfts), "ttft_p50": statistics.median(ttfts), "ttft_p90": q[8], **counters}
print(json.dumps(row)); open(f"{out}/{label}.json", "w").write(json.dumps(row))
PYEOF
  kill "$pid"; wait "$pid" || true
}

run_one no-tier ""
run_one host-tier "{\"hostGiB\": $HOST_GIB}"
"$PY" -c "import json; a, b = (json.load(open('$OUT/' + n + '.json')) for n in ('no-tier', 'host-tier')); print(f\"TTFT p90 with the tier / without: {b['ttft_p90'] / a['ttft_p90']:.2f}\")"
