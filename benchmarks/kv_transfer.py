"""KV transfer throughput: the pair channel beside plain ``torch.distributed`` send/recv.

Moves the KV of 1k, 4k and 16k-token prompts from a prefill-side process to this
(decode-side) process, for two KV geometries (block_size 16; bf16, or with
``--kv-cache-dtype int8`` / ``fp8`` / ``fp8_e5m2`` one byte a value and the blocks' fp32
scales, about half the bytes a token: the workers' ``--kv-cache-dtype``):

- ``llama-125m``: 12 layers, 4 KV heads, head_dim 64 (the test models' shape): 12 KiB
  per token, 192 KiB per block;
- ``llama-3-8b``: 32 layers, 8 KV heads, head_dim 128 (Llama 3.1 8B, Mistral 7B): 128 KiB
  per token, 2 MiB per block.

Both caches are laid out as the workers' (block-major storage on huge pages). Each size is
timed four ways, in turn, on the same loopback link (the pair channel over its own
authenticated TCP connection, ``kvtransfer/socket_pair.py``; the baseline over gloo):

- plain: the same bytes as one contiguous region of the same caches (their first blocks),
  ``send`` / ``recv`` on a 2-rank gloo group (no gather, no scatter, no protocol);
- pair, consecutive: ``KVReceiver.init`` + ``KVSender.send`` with consecutive block ids
  on both sides (fresh block pools): messages of up to 8 MiB straight from and into the
  caches;
- pair, scattered: random block ids on both sides (fragmented pools): one message per
  block, still straight from and into the caches;
- pair, mixed: random ids on the prefill side, consecutive on the decode side: 8 MiB
  messages the sender gathers into its ring (``pdserve.kvtransfer.payload``).

Times are wall seconds at the receiver, from just before its first call (plain: posting
the ``recv``; pair: ``init``), which precedes asking the sender to send, until the bytes
are in place (pair: the pull's SUCCESS). Each pair transfer follows a plain one, so the
two see the same drift in this machine's speed. Printed: the KV dtype and bytes per token
(a block's bytes, scales included, over its tokens), GB/s of the median of ``--reps``
runs, the ratio of the medians pair / plain, and in brackets the lowest and highest ratio
of a pair transfer to the plain one just before it. The sending process tags every block
of its cache once before the first transfer (``KVSender.tag_blocks``, as a prefill worker
tags the blocks it wrote while the router picks a decode worker; printed as GB/s, and it
checks at the end that no send had to tag a block itself), so a transfer sends those tags
and the receiver checks each block as it lands (``kvtransfer/auth.py``). Every pair
transfer is also run right after or right before (in turn), on the same blocks, without
verification (stand-ins that compute and check nothing, in both processes, over the same
frames): the "tags" line is pair throughput with verification over without, the median
of each such pair of runs (lowest and highest in brackets; the machine's drift between
one size's runs cancels) and, after "med", the ratio of the two medians. Run:
``python benchmarks/kv_transfer.py --kv-cache-dtype auto --kv-cache-dtype int8``
(``--reps``: 41 by default, what the "tags" median needs on a noisy 2-vCPU machine).

``--device cuda`` puts both caches on the GPU (both processes on GPU 0: two CUDA
contexts) and moves the bytes over NCCL, plain and pair alike: each process gets its own
``NCCL_HOSTID``, without which NCCL refuses two ranks on one GPU, so NCCL takes its
network transport between them (on one GPU, the pair channel's only NCCL path; between
two GPUs of a host NCCL would use NVLink or PCIe instead). Plain is then a
``ProcessGroupNCCL`` send / recv of the cache's leading bytes; times end when the bytes
are on the GPU (``torch.cuda.synchronize``).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.distributed as dist

from pdserve.engine.kv_cache_layout import KVCacheLayout
from pdserve.kernels.kv_quant import KV_CACHE_DTYPE_NAMES, kv_cache_torch_dtype
from pdserve.kvtransfer import KVPollState, KVReceiver, KVSender
from pdserve.kvtransfer import receiver as kv_receiver
from pdserve.kvtransfer import sender as kv_sender
from pdserve.kvtransfer.auth import TRAILER_NUMEL, BlockVerifier, PayloadDigest
from pdserve.kvtransfer.payload import wire_view

KV_KEY = hashlib.sha256(b"pdserve test cluster: kv").digest()  # both processes

BLOCK_SIZE = 16
DTYPE = torch.bfloat16
PROMPT_TOKENS = (1024, 4096, 16384)
GEOMETRIES = {  # name: (num_layers, num_kv_heads, head_dim)
    "llama-125m": (12, 4, 64),
    "llama-3-8b": (32, 8, 128),
}
LAYOUTS = ("consecutive", "scattered", "mixed")


def make_cache(geometry: str, num_blocks: int, seed: int | None, device: str = "cpu",
               kv_cache_dtype: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(kv_cache [num_layers, 2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim],
    kv_scales)`` laid out as a worker's (``engine/kv_cache_layout.py``): block-major
    storage, on huge pages on the CPU; bf16 for ``auto``, else quantized with scales;
    random bytes with ``seed``."""
    num_layers, num_kv_heads, head_dim = GEOMETRIES[geometry]
    layout = KVCacheLayout(num_layers, BLOCK_SIZE, num_kv_heads, head_dim,
                           kv_cache_torch_dtype(kv_cache_dtype, DTYPE))
    kv_cache, kv_scales = layout.allocate(num_blocks, torch.device(device))
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
        storage_bytes(kv_cache, kv_scales).random_(0, 256, generator=gen)
    return kv_cache, kv_scales


def storage_bytes(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor:
    """The cache's whole block-major storage as flat uint8 (scales included)."""
    if kv_scales is not None:
        return wire_view(kv_cache, kv_scales).reshape(-1)
    return kv_cache.permute(2, 0, 1, 3, 4, 5).reshape(-1).view(torch.uint8)


def use_device(device: str, rank: int) -> None:
    """For a CUDA run: this process's own ``NCCL_HOSTID`` (before any NCCL group)."""
    if device != "cpu":
        os.environ["NCCL_HOSTID"] = f"pdserve-bench-rank{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        torch.cuda.set_device(0)


def finish(device: str) -> None:
    """Wait for the GPU (an NCCL wait only orders streams)."""
    if device != "cpu":
        torch.cuda.synchronize()


def leading_bytes(cache: tuple[torch.Tensor, torch.Tensor | None], num_bytes: int
                  ) -> torch.Tensor:
    """The first ``num_bytes`` of the cache's block-major storage, as contiguous uint8
    (plain send/recv moves the payload's bytes from and into the caches' own memory)."""
    return storage_bytes(*cache)[:num_bytes]


def plain_group(address: str, rank: int, device: str = "cpu"):
    host, port = address.split(":")
    store = dist.TCPStore(host, int(port), None, rank == 1, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    if device != "cpu":
        group = dist.ProcessGroupNCCL(dist.PrefixStore("bench/plain", store), rank, 2,
                                      dist.ProcessGroupNCCL.Options())
        probe = torch.zeros(1, device=device)  # NOTE: NCCL connects at the first op
        (group.send if rank == 0 else group.recv)([probe], 1 - rank, 0).wait()
        torch.cuda.synchronize()
        return group
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = datetime.timedelta(seconds=60)
    return dist.ProcessGroupGloo(dist.PrefixStore("bench/plain", store), rank, 2, opts)


def bindings_of(block_ids: list[int]) -> list[bytes]:
    """What the sender's blocks "hold" here (a worker binds them to the prompt's tokens,
    ``engine.block_hash.block_bindings``): the same on both sides, fixed per block, so
    that each block is tagged once, up front, as a prefill worker tags what it writes."""
    return [hashlib.sha256(b"bench block %d" % b).digest()[:20] for b in block_ids]


class _UncheckedBlocks:
    """``auth.BlockVerifier`` for the "untagged" runs: checks nothing."""

    def __init__(self, *args) -> None:
        pass

    def landed(self, view, upto: int) -> None:
        pass

    def ok(self) -> bool:
        return True


class _UntaggedDigest:
    """What the pair transfer costs without its GMAC tags (``kvtransfer/auth.py``):
    the same messages (an all-zero tag), nothing computed or checked. Only for this
    benchmark's "untagged" runs; the KV path has no such mode."""

    def __init__(self, key: bytes) -> None:
        pass

    def update(self, tensor: torch.Tensor) -> None:
        pass

    def update_bytes(self, data: memoryview) -> None:
        pass

    def trailer(self) -> torch.Tensor:
        return torch.zeros(TRAILER_NUMEL, dtype=torch.int64)

    def verify(self, trailer: torch.Tensor) -> bool:
        return True


def set_tags(tagged: bool) -> None:
    """Tag payloads (the KV path as it is) or not (``_UntaggedDigest``,
    ``_UncheckedBlocks``: the same frames, nothing computed or checked), in this
    process."""
    digest = PayloadDigest if tagged else _UntaggedDigest
    kv_sender.PayloadDigest = kv_receiver.PayloadDigest = digest
    kv_receiver.BlockVerifier = BlockVerifier if tagged else _UncheckedBlocks


def prefill_main(conn, geometry: str, num_blocks: int, plain_address: str,
                 threads: int, device: str = "cpu", kv_cache_dtype: str = "auto") -> None:
    """The sending process: answers ("pair", rid, decode_id, address, ids, timeout_s,
    ticket) and ("plain", num_bytes) until None."""
    torch.set_num_threads(threads)
    use_device(device, 0)
    cache = make_cache(geometry, num_blocks, 1, device, kv_cache_dtype)
    sender = KVSender("bench-prefill", cache[0], kv_key=KV_KEY, kv_scales=cache[1], timeout_s=120)
    group = plain_group(plain_address, 0, device)
    # NOTE: every block tagged once, as a prefill worker tags the blocks it wrote
    start = time.perf_counter()
    sender.tag_blocks(range(num_blocks), bindings_of(list(range(num_blocks)))).result()
    tag_gbps = num_blocks * sender.geometry.block_bytes / (time.perf_counter() - start) / 1e9
    conn.send(("ready", tag_gbps))
    while (cmd := conn.recv()) is not None:
        if cmd[0] == "plain":
            group.send([leading_bytes(cache, cmd[1])], 1, 0).wait()
            finish(device)
        elif cmd[0] == "tags":
            set_tags(cmd[1])
        else:
            sender.send(*cmd[1:], bindings=bindings_of(cmd[4]))
        conn.send("done")
    assert sender.tagger.tagged_on_send == 0  # every send found its blocks' tags
    sender.close()


def time_plain(conn, group, payload: torch.Tensor) -> float:
    start = time.perf_counter()  # NOTE: before posting the recv, as the pair's before init
    work = group.recv([payload], 0, 0)
    conn.send(("plain", payload.numel()))
    work.wait()
    finish(payload.device.type)
    elapsed = time.perf_counter() - start
    conn.recv()
    return elapsed


def time_pair(conn, receiver: KVReceiver, rid: str, src: list[int], dst: list[int],
              tagged: bool = True) -> float:
    set_tags(tagged)
    conn.send(("tags", tagged))
    conn.recv()
    start = time.perf_counter()
    pull = receiver.init(rid, "bench-prefill", dst, timeout_s=120, bindings=bindings_of(src))
    # NOTE: with the ticket, as the decode worker's SendKV passes it
    conn.send(("pair", rid, receiver.worker_id, receiver.address, src, None, pull.ticket_text))
    assert pull.wait(120) == KVPollState.SUCCESS, pull.failure_exception()
    elapsed = time.perf_counter() - start
    conn.recv()
    return elapsed


def block_ids(num_blocks: int, n: int, layout: str, gen: torch.Generator) -> list[int]:
    """``n`` ids: the last ``n`` (consecutive), or ``n`` of all in random order."""
    if layout == "consecutive":
        return list(range(num_blocks - n, num_blocks))
    return torch.randperm(num_blocks, generator=gen)[:n].tolist()


def run(geometry: str, reps: int, threads: int,
        prompt_tokens: tuple[int, ...] = PROMPT_TOKENS, device: str = "cpu",
        kv_cache_dtype: str = "auto") -> list[dict]:
    """Time every size (``prompt_tokens``, multiples of ``BLOCK_SIZE``) and layout for one
    geometry and KV dtype; one row per size: bytes, GB/s and ratios as ``main`` prints
    them."""
    torch.set_num_threads(threads)
    use_device(device, 1)
    num_blocks = max(prompt_tokens) // BLOCK_SIZE + 64
    cache = make_cache(geometry, num_blocks, None, device, kv_cache_dtype)
    receiver = KVReceiver("bench-decode", cache[0],
                          kv_key=KV_KEY, kv_scales=cache[1], timeout_s=120)
    plain_address = f"127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=prefill_main, daemon=True, args=(
        child_conn, geometry, num_blocks, plain_address, threads, device, kv_cache_dtype))
    child.start()
    group = plain_group(plain_address, 1, device)
    ready, tag_gbps = conn.recv()
    assert ready == "ready"
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in prompt_tokens:
        n = tokens // BLOCK_SIZE
        num_bytes = n * receiver.geometry.block_bytes
        times: dict[str, list[float]] = {k: [] for k in ("plain", *LAYOUTS)}
        untagged: dict[str, list[float]] = {k: [] for k in LAYOUTS}
        for rep in range(reps + 1):  # NOTE: the first round warms up and is dropped
            for layout in LAYOUTS:
                # NOTE: a plain transfer just before each pair transfer, for its ratio
                times["plain"].append(time_plain(conn, group, leading_bytes(cache, num_bytes)))
                src = block_ids(num_blocks, n, layout, gen)
                dst = block_ids(num_blocks, n, "consecutive" if layout == "mixed" else layout,
                                gen)
                # NOTE: the same blocks again without verification, for its cost; which
                # of the two goes first alternates, so neither gains from its place
                for tagged in (True, False) if rep % 2 == 0 else (False, True):
                    (times[layout] if tagged else untagged[layout]).append(time_pair(
                        conn, receiver, f"{tokens}-{layout}-{rep}{'' if tagged else 'u'}",
                        src, dst, tagged=tagged))
        row = {"geometry": geometry, "kv_cache_dtype": kv_cache_dtype, "tokens": tokens,
               "blocks": n, "bytes": num_bytes, "bytes_per_token": num_bytes / tokens,
               "plain_gbps": num_bytes / statistics.median(times["plain"][len(LAYOUTS):]) / 1e9,
               "tag_gbps": tag_gbps}
        for i, layout in enumerate(LAYOUTS):
            pair = times[layout][1:]
            plain = times["plain"][len(LAYOUTS) + i::len(LAYOUTS)]  # NOTE: the one just before
            ratios = sorted(p / q for p, q in zip(plain, pair))
            row[f"{layout}_gbps"] = num_bytes / statistics.median(pair) / 1e9
            row[f"{layout}_ratio"] = row[f"{layout}_gbps"] / row["plain_gbps"]
            row[f"{layout}_ratio_range"] = (ratios[0], ratios[-1])
            # NOTE: throughput with verification / without: time without / time with, of
            # each transfer and its unverified twin run beside it (drift between reps
            # cancels), and of the medians
            paired = sorted(u / t for t, u in zip(pair, untagged[layout][1:]))
            row[f"{layout}_tagged_ratio"] = statistics.median(paired)
            row[f"{layout}_tagged_ratio_range"] = (paired[0], paired[-1])
            row[f"{layout}_tagged_ratio_of_medians"] = (statistics.median(untagged[layout][1:])
                                                        / statistics.median(pair))
        rows.append(row)
    conn.send(None)
    child.join(30)
    receiver.close()
    set_tags(True)  # NOTE: this process's KV path as it was (a test may go on using it)
    return rows


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # NOTE: a pair of runs on a 2-vCPU VM ranged 0.6-1.7 in "tags" (verified / not); the
    # median of 41 pairs settled within a few hundredths, 15 still left rows 0.1 off
    parser.add_argument("--reps", type=int, default=41,
                        help="timed runs per size and layout (about 5 minutes on 2 vCPUs)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--geometry", choices=GEOMETRIES, action="append",
                        help="KV geometry (repeatable; default: all)")
    parser.add_argument("--prompt-tokens", type=int, action="append",
                        help=f"prompt sizes in tokens (repeatable; default {PROMPT_TOKENS})")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the caches live; cuda: both processes on GPU 0, NCCL")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_NAMES, action="append",
                        help="the caches' --kv-cache-dtype (repeatable; auto: bf16; "
                        "default: auto)")
    args = parser.parse_args()
    if args.device == "cuda":
        print(f"{torch.cuda.get_device_name()}: both processes on GPU 0, NCCL "
              "(distinct NCCL_HOSTID: its network transport)")
    print("GB/s: median of the timed runs; ratio: pair / plain of the medians (lowest-highest "
          "of each pair run against the plain run before it); tags: pair throughput with "
          "verification (block tags, GMAC of header and tags) / without, the same blocks "
          "right before or after: median of each pair of runs (lowest-highest), and "
          "'med': of the medians")
    print(f"{'geometry':>10} {'kv':>8} {'B/token':>7} {'prompt':>6} {'MiB':>6} {'plain':>6}"
          + "".join(f" {layout:>11} {'ratio':>15}" for layout in LAYOUTS))
    for geometry in args.geometry or GEOMETRIES:
        for kv_cache_dtype in args.kv_cache_dtype or ["auto"]:
            for r in run(geometry, args.reps, args.threads,
                         tuple(args.prompt_tokens or PROMPT_TOKENS), args.device,
                         kv_cache_dtype):
                line = (f"{geometry:>10} {kv_cache_dtype:>8} {r['bytes_per_token']:>7.0f} "
                        f"{r['tokens']:>6} {r['bytes'] / 2**20:>6.1f} {r['plain_gbps']:>6.2f}")
                for layout in LAYOUTS:
                    low, high = r[f"{layout}_ratio_range"]
                    line += (f" {r[f'{layout}_gbps']:>11.2f} {r[f'{layout}_ratio']:>5.2f} "
                             f"({low:.2f}-{high:.2f})")
                print(line, flush=True)
                tags = ""
                for layout in LAYOUTS:
                    low, high = r[f"{layout}_tagged_ratio_range"]
                    of_medians = f"med {r[f'{layout}_tagged_ratio_of_medians']:.2f}"
                    tags += (f" {of_medians:>11} {r[f'{layout}_tagged_ratio']:>5.2f} "
                             f"({low:.2f}-{high:.2f})")
                print(f"{'':>10} {'':>8} {'':>7} {'':>6} {'':>6} {'tags':>6}" + tags,
                      flush=True)
            print(f"{'':>10} {kv_cache_dtype:>8} tagging every block once on the sending "
                  f"side (as prefill does): {r['tag_gbps']:.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
