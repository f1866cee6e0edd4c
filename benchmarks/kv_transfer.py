"""KV transfer throughput: the pair channel beside plain ``torch.distributed`` send/recv.

Moves the KV of 1k, 4k and 16k-token prompts from a prefill-side process to this
(decode-side) process, with a ~125M Llama's KV geometry (12 layers, 4 KV heads,
head_dim 64, block_size 16, bf16: 12 KiB per token, 192 KiB per block), both caches laid
out as the workers' (block-major storage on huge pages). Each size is timed four ways,
in turn, on the same loopback link and backend (gloo):

- plain: one contiguous tensor of the same bytes, ``send`` / ``recv`` on a 2-rank gloo
  group made the same way (no gather, no scatter, no protocol);
- pair, consecutive: ``KVReceiver.init`` + ``KVSender.send`` with consecutive block ids
  on both sides (fresh block pools): 2 MiB messages straight from and into the caches;
- pair, scattered: random block ids on both sides (fragmented pools): one message per
  block, still straight from and into the caches;
- pair, mixed: random ids on the prefill side, consecutive on the decode side: 2 MiB
  messages the sender gathers into its ring (``pdserve.kvtransfer.payload``).

Times are wall seconds at the receiver, from just before its first call (plain: posting
the ``recv``; pair: ``init``), which precedes asking the sender to send, until the bytes
are in place (pair: the pull's SUCCESS). Printed: GB/s of the median of ``--reps`` runs
and of the best run, and the ratios pair / plain of both. Run:
``python benchmarks/kv_transfer.py``.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import time

import torch
import torch.distributed as dist

from pdserve.engine.model_runner import cpu_zeros_on_huge_pages
from pdserve.kvtransfer import KVPollState, KVReceiver, KVSender

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 12, 16, 4, 64
DTYPE = torch.bfloat16
PROMPT_TOKENS = (1024, 4096, 16384)


def make_cache(num_blocks: int, seed: int | None) -> torch.Tensor:
    """``[NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]`` bf16, laid out
    as a worker's (``ModelRunner.allocate_kv_cache``): block-major storage on huge pages."""
    storage = cpu_zeros_on_huge_pages(
        (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), DTYPE)
    if seed is not None:
        storage.normal_(generator=torch.Generator().manual_seed(seed))
    return storage.permute(1, 2, 0, 3, 4, 5)


def plain_group(address: str, rank: int) -> dist.ProcessGroupGloo:
    host, port = address.split(":")
    store = dist.TCPStore(host, int(port), None, rank == 1, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = datetime.timedelta(seconds=60)
    return dist.ProcessGroupGloo(dist.PrefixStore("bench/plain", store), rank, 2, opts)


def prefill_main(conn, num_blocks: int, plain_address: str, threads: int) -> None:
    """The sending process: answers ("pair", rid, decode_id, address, ids, timeout_s,
    ticket) and ("plain", num_bytes) until None."""
    torch.set_num_threads(threads)
    sender = KVSender("bench-prefill", make_cache(num_blocks, 1), timeout_s=60)
    group = plain_group(plain_address, 0)
    payloads: dict[int, torch.Tensor] = {}
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        if cmd[0] == "plain":
            if cmd[1] not in payloads:
                payloads[cmd[1]] = torch.ones(cmd[1], dtype=torch.uint8)
            group.send([payloads[cmd[1]]], 1, 0).wait()
        else:
            sender.send(*cmd[1:])
        conn.send("done")


def time_plain(conn, group, payload: torch.Tensor) -> float:
    start = time.perf_counter()  # NOTE: before posting the recv, as the pair's before init
    work = group.recv([payload], 0, 0)
    conn.send(("plain", payload.numel()))
    work.wait()
    elapsed = time.perf_counter() - start
    conn.recv()
    return elapsed


def time_pair(conn, receiver: KVReceiver, rid: str, src: list[int], dst: list[int]) -> float:
    start = time.perf_counter()
    pull = receiver.init(rid, "bench-prefill", dst, timeout_s=60)
    # NOTE: with the ticket, as the decode worker's SendKV passes it
    conn.send(("pair", rid, receiver.worker_id, receiver.address, src, None, pull.ticket_text))
    assert pull.wait(60) == KVPollState.SUCCESS, pull.failure_exception()
    elapsed = time.perf_counter() - start
    conn.recv()
    return elapsed


def block_ids(num_blocks: int, n: int, layout: str, gen: torch.Generator) -> list[int]:
    if layout == "consecutive":
        return list(range(num_blocks - n, num_blocks))
    if layout == "mixed":  # NOTE: the sender's side of "mixed"; the receiver's is consecutive
        return torch.randperm(num_blocks, generator=gen)[:n].tolist()
    return torch.randperm(num_blocks, generator=gen)[:n].tolist()


def run(reps: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    num_blocks = max(PROMPT_TOKENS) // BLOCK_SIZE + 64
    receiver = KVReceiver("bench-decode", make_cache(num_blocks, None), timeout_s=60)
    plain_address = f"127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=prefill_main, args=(child_conn, num_blocks, plain_address,
                                                   threads), daemon=True)
    child.start()
    group = plain_group(plain_address, 1)
    assert conn.recv() == "ready"
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in PROMPT_TOKENS:
        n = tokens // BLOCK_SIZE
        num_bytes = n * receiver.geometry.block_bytes
        times: dict[str, list[float]] = {"plain": [], "consecutive": [], "scattered": [],
                                         "mixed": []}
        plain_payload = torch.zeros(num_bytes, dtype=torch.uint8)  # NOTE: faulted in once
        for rep in range(reps + 1):  # NOTE: rep 0 warms up and is dropped
            times["plain"].append(time_plain(conn, group, plain_payload))
            for layout in ("consecutive", "scattered", "mixed"):
                src = block_ids(num_blocks, n, layout, gen)
                dst = block_ids(num_blocks, n, "consecutive" if layout == "mixed" else layout,
                                gen)
                times[layout].append(time_pair(conn, receiver, f"{tokens}-{layout}-{rep}",
                                               src, dst))
        medians = {k: statistics.median(v[1:]) for k, v in times.items()}
        bests = {k: min(v[1:]) for k, v in times.items()}
        rows.append({"tokens": tokens, "blocks": n, "bytes": num_bytes,
                     **{f"{k}_gbps": num_bytes / v / 1e9 for k, v in medians.items()},
                     **{f"{k}_best_gbps": num_bytes / v / 1e9 for k, v in bests.items()}})
    conn.send(None)
    child.join(10)
    receiver.close()
    return rows


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed runs per size (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    rows = run(args.reps, args.threads)
    layouts = ("consecutive", "scattered", "mixed")
    print("GB/s: median of the timed runs (best in brackets); ratio: pair / plain, of the "
          "medians (of the bests)")
    print(f"{'prompt':>7} {'MiB':>5} {'plain':>12}"
          + "".join(f" {'pair ' + layout:>18} {'ratio':>11}" for layout in layouts))
    for r in rows:
        line = (f"{r['tokens']:>7} {r['bytes'] / 2**20:>5.0f} "
                f"{r['plain_gbps']:>5.2f} ({r['plain_best_gbps']:>4.2f})")
        for layout in layouts:
            median, best = r[f"{layout}_gbps"], r[f"{layout}_best_gbps"]
            line += (f" {median:>11.2f} ({best:>4.2f}) {median / r['plain_gbps']:>4.2f} "
                     f"({best / r['plain_best_gbps']:>4.2f})")
        print(line)


if __name__ == "__main__":
    main()
