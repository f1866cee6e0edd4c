"""The router at scale (issue 31; benchmarks/README.md, "Router at scale"): routing
decisions per second, lookup and decision latency, and Redis memory, at 10 / 100 / 1,000
simulated workers.

No engines: each simulated worker publishes its cached blocks through pdserve's own write
path (``KVEventPublisher``, one per worker, into a real ``redis-server`` on a free port);
one router process follows the index (``LocalPrefixIndex``) and decides with the request
path's own routing step (``router.model_service.RoutingStep``, what ``ModelService``
calls per request: hash, in-memory lookup, admission masks, ``Router``'s array scoring,
metrics and in-flight bookkeeping) over a ``WorkerPool`` of the simulated workers' records
and loads, 64 decisions in flight on one asyncio loop.

Sharing model: 200 system prompts of 4-64 blocks, Zipf popularity (prompt k on a worker
with probability (k+1)^-0.5: the first everywhere, the last on 7% of workers); private
conversation tails of 8-192 blocks after a Zipf-chosen system prompt, each cached on one
prefill and one decode worker, until the registrations are reached. Prompts of 256 and
2,048 tokens, a third each with no shared prefix, a cached system prompt, and a
continued conversation.

    python benchmarks/router_scale.py                       # 10, 100, 1000 workers, 10M
    python benchmarks/router_scale.py --workers 100 --registrations 1000000 --seconds 5

``--registrations`` is the total at the largest size; smaller sizes get the same number
per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pdserve.cluster import block_index
from pdserve.cluster.prefix_follower import LocalPrefixIndex
from pdserve.cluster.prefix_index import KVEventPublisher, PrefixIndex
from pdserve.cluster.registry import WorkerRecord
from pdserve.engine.block_hash import root_block_hash
from pdserve.engine.block_pool import KVEvent, KVEventKind
from pdserve.engine.sampling_params import SamplingParams
from pdserve.entrypoints.redis_server import RedisServer
from pdserve.router.config import RouterConfig
from pdserve.router.generate_request import GenerateRequest
from pdserve.router.metrics import RouterMetrics
from pdserve.router.model_service import RoutingStep
from pdserve.router.routing_policy import WorkerLoad
from pdserve.router.workers import WorkerPool

BLOCK = 16
VOCAB = 32000
NUM_SYSTEM_PROMPTS = 200
MODEL = "router-scale"
ROOT = root_block_hash(MODEL, BLOCK)


class Sharing:
    """Which worker caches which blocks (the module docstring's model)."""

    def __init__(self, num_workers: int, registrations: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.prefill = [f"prefill-{i:04d}" for i in range(num_workers // 2)]
        self.decode = [f"decode-{i:04d}" for i in range(num_workers - num_workers // 2)]
        self.workers = self.prefill + self.decode
        self.system = [rng.integers(0, VOCAB, BLOCK * int(rng.integers(4, 65))).tolist()
                       for _ in range(NUM_SYSTEM_PROMPTS)]
        self.system_hashes = [block_index.hash_chain(t, BLOCK, ROOT) for t in self.system]
        zipf = 1.0 / np.arange(1, NUM_SYSTEM_PROMPTS + 1) ** 1.1
        self.popularity = zipf / zipf.sum()
        everywhere = np.arange(1, NUM_SYSTEM_PROMPTS + 1) ** -0.5
        self.holds = {w: [k for k in range(NUM_SYSTEM_PROMPTS) if rng.random() < everywhere[k]]
                      for w in self.workers}
        shared = sum(len(self.system_hashes[k]) for w in self.workers for k in self.holds[w])
        self.conversations: list[tuple[int, int]] = []  # (system prompt, tail blocks)
        self.owners: dict[str, list[int]] = {w: [] for w in self.workers}
        left = registrations - shared
        while left > 0:
            c = len(self.conversations)
            k, tail = int(rng.choice(NUM_SYSTEM_PROMPTS, p=self.popularity)), \
                int(rng.integers(8, 193))
            self.conversations.append((k, tail))
            for w in (rng.choice(self.prefill), rng.choice(self.decode)):
                self.owners[str(w)].append(c)
            left -= 2 * tail
        self.registrations = registrations - min(left, 0)

    def conversation_tokens(self, c: int) -> list[int]:
        k, tail = self.conversations[c]
        tail_tokens = np.random.default_rng(1_000_003 + c).integers(0, VOCAB, tail * BLOCK)
        return self.system[k] + tail_tokens.tolist()

    def worker_hashes(self, worker: str) -> list[bytes]:
        hashes = {h for k in self.holds[worker] for h in self.system_hashes[k]}
        for c in self.owners[worker]:
            hashes.update(block_index.hash_chain(self.conversation_tokens(c), BLOCK, ROOT))
        return list(hashes)

    def prompts(self, n: int) -> list[list[int]]:
        rng, out = self.rng, []
        for i in range(n):
            length = (256, 2048)[i % 2]
            kind = (i // 2) % 3
            if kind == 0:
                prefix: list[int] = []
            elif kind == 1:
                prefix = self.system[int(rng.choice(NUM_SYSTEM_PROMPTS, p=self.popularity))]
            else:
                c = int(rng.integers(len(self.conversations))) if self.conversations else 0
                prefix = self.conversation_tokens(c) if self.conversations else []
            prefix = prefix[:length - BLOCK]
            out.append(prefix + rng.integers(0, VOCAB, length - len(prefix)).tolist())
        return out


def publish(url: str, sharing: Sharing, parallel: int = 8) -> float:
    """Every worker's blocks through its own ``KVEventPublisher``; returns seconds."""
    def one(worker: str) -> None:
        publisher = KVEventPublisher(url, worker, socket_timeout_s=30.0)
        publisher(KVEvent(KVEventKind.STORED, tuple(sharing.worker_hashes(worker))))
        if not publisher.flush(timeout_s=600):
            raise RuntimeError(f"{worker}: publish did not finish")
        publisher.close()  # NOTE: no purge: the blocks stay, as a live worker's do

    start = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(one, sharing.workers))
    return time.perf_counter() - start


class SimulatedRegistry:
    """The simulated workers' registry records (``WorkerPool`` reads ``list_live``)."""

    def __init__(self, sharing: Sharing, placements: dict[str, str]) -> None:
        self.records = [WorkerRecord(w, w.split("-")[0], "127.0.0.1:1", "127.0.0.1:2", 1,
                                     MODEL, 0.0, compute=placements[w])
                        for w in sharing.workers]
        self.rejected_ids: set[str] = set()

    def list_live(self) -> list[WorkerRecord]:
        """Every simulated worker's record."""
        return list(self.records)


async def decide(routing: RoutingStep, prompts: list[list[int]], seconds: float,
                 concurrency: int) -> dict:
    """``concurrency`` tasks deciding for ``seconds`` as ``ModelService._attempt`` does
    (the lookup, the decode worker, its in-flight count, the prefill path); latencies per
    decision. Each request's in-flight counts are given back at once. Also the router
    thread's CPU time per decision (the loop's included): on a machine shared with other
    work, what one quiet core would give as 1e6 / it decisions/s."""
    lookups, decisions = [], []
    requests = [GenerateRequest(str(i), tokens, SamplingParams())
                for i, tokens in enumerate(prompts)]
    deadline = time.perf_counter() + seconds

    async def loop(offset: int) -> None:
        i = offset
        while time.perf_counter() < deadline:
            request = requests[i % len(requests)]
            num_tokens = len(request.prompt_token_ids)
            t0 = time.perf_counter()
            num_blocks, counts = await routing.prefix_counts(request)
            t1 = time.perf_counter()
            router = routing.pool.router
            decode, position = routing.choose_decode(router, set(), True, counts, num_tokens)
            decode.num_inflight += 1
            prefill = routing.choose_prefill(router, position, set(), True, counts,
                                             num_tokens, num_blocks)
            t2 = time.perf_counter()
            decode.num_inflight -= 1
            if prefill is not None:
                prefill.num_inflight -= 1
            lookups.append(t1 - t0)
            decisions.append(t2 - t0)
            i += concurrency
            await asyncio.sleep(0)

    start, cpu_start = time.perf_counter(), time.thread_time()
    await asyncio.gather(*(loop(k) for k in range(concurrency)))
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    ms = lambda xs, q: float(np.percentile(xs, q) * 1e3)
    return {"decisions_per_s": len(decisions) / wall, "lookup_p50_ms": ms(lookups, 50),
            "lookup_p99_ms": ms(lookups, 99), "decision_p50_ms": ms(decisions, 50),
            "decision_p99_ms": ms(decisions, 99), "num_decisions": len(decisions),
            "cpu_us_per_decision": cpu * 1e6 / max(len(decisions), 1)}


async def route_requests(url: str, index: LocalPrefixIndex, sharing: Sharing,
                         seconds: float, concurrency: int) -> dict:
    """The pool of the simulated workers (records, placements, a health poll's loads) and
    its routing step; ``decide`` over 3,000 prompts of the sharing model."""
    rng = np.random.default_rng(1)
    placements = {w: f"cpu@host{i // 8}:{i % 8}" for i, w in enumerate(sharing.workers)}
    config = RouterConfig(MODEL, url, block_size=BLOCK, local_prefill_threshold=0)
    pool = WorkerPool(SimulatedRegistry(sharing, placements), config)
    routing = RoutingStep(config, pool, RouterMetrics(MODEL), index, ROOT)
    pool.slot_index = index
    await pool.refresh()
    for known in pool.workers.values():
        for worker in known.values():  # a health poll's answers
            worker.healthy = True
            worker.load = WorkerLoad(worker.worker_id, int(rng.integers(0, 8)),
                                     int(rng.integers(0, 4)), float(rng.random()))
    pool.router.refresh_slots()
    try:
        return await decide(routing, sharing.prompts(3000), seconds, concurrency)
    finally:
        await pool.close()


def run_size(num_workers: int, registrations: int, seconds: float, concurrency: int) -> dict:
    sharing = Sharing(num_workers, registrations)
    with RedisServer() as server:
        publish_s = publish(server.url, sharing)
        client = PrefixIndex(server.url, socket_timeout_s=30.0)
        used = client.used_memory()
        client.close()
        start = time.perf_counter()
        index = LocalPrefixIndex(server.url, socket_timeout_s=30.0)  # the router's capacity
        try:
            if not index.wait_loaded(timeout_s=1800):
                raise RuntimeError("the router's index did not load")
            load_s = time.perf_counter() - start
            result = asyncio.run(route_requests(server.url, index, sharing, seconds,
                                                concurrency))
            result["load_average"] = os.getloadavg()[0]  # the last minute's, at the end
        finally:
            index.close()
    return {"workers": num_workers, "registrations": sharing.registrations,
            "publish_s": publish_s, "router_load_s": load_s,
            "redis_used_memory_mb": used / 2**20, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--registrations", type=int, default=10_000_000,
                        help="(worker, block) registrations at the largest size")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = []
    print("| workers | registrations | decisions/s | lookup p50 / p99 (ms) | decision p50 / "
          "p99 (ms) | CPU per decision (us) | Redis used_memory (MB) | publish (s) | "
          "router load (s) | load average |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.workers:
        per_worker = args.registrations // max(args.workers)
        row = run_size(n, per_worker * n, args.seconds, args.concurrency)
        rows.append(row)
        print(f"| {n} | {row['registrations']:,} | {row['decisions_per_s']:,.0f} | "
              f"{row['lookup_p50_ms']:.3f} / {row['lookup_p99_ms']:.3f} | "
              f"{row['decision_p50_ms']:.3f} / {row['decision_p99_ms']:.3f} | "
              f"{row['cpu_us_per_decision']:.0f} | "
              f"{row['redis_used_memory_mb']:,.0f} | {row['publish_s']:.0f} | "
              f"{row['router_load_s']:.1f} | {row['load_average']:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
