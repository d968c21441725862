"""Benchmark the coordinator RPCs against a bare hivemind P2P stream of the same bytes, on loopback.

Two p2pd daemons on 127.0.0.1 in one Python process (so both ends share one GIL, as do the raw
baselines: the ratio is the figure, absolute MB/s are a floor). For every size and codec:

- upload: ``CoordinatorClient.submit`` of a pre-encoded pseudo-gradient (transport only) vs a raw stream
  that sends the same number of bytes in the same 1 MiB chunks and waits for a 1-byte ack;
- download: ``CoordinatorClient.get_model`` end to end (server encode + transfer + client decode) vs a
  raw stream of the same bytes;
- encode and decode time of each codec alone (``asyncloco.transport.codecs``).

Usage: ``python scripts/bench_transport.py [--quick] [--sizes 1e6 1e7 2.5e7] [--repeats 3] [--json out]``.
Prints a Markdown table (the one in docs/transport.md comes from here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

import torch
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from asyncloco.transport.codecs import CODECS, EncodedTensor, decode, encode, wire_bytes
from asyncloco.transport.framing import CHUNK_BYTES, read_until_closed
from asyncloco.transport.rpc import CoordinatorClient, CoordinatorService
from asyncloco.transport.wire import Ack, AssignRequest, LeaseReply, SubmitHeader

logger = logging.getLogger("bench_transport")

RAW_UPLOAD, RAW_DOWNLOAD = "bench.raw_upload", "bench.raw_download"
MODEL_CODECS = ("none", "bf16", "int8")


@dataclass
class Row:
    numel: int
    codec: str
    wire_mb: float
    encode_s: float
    decode_s: float
    upload_s: float
    raw_upload_s: float
    download_s: Optional[float]
    raw_download_s: Optional[float]


class BenchHandler:
    """Serves a fixed θ and acknowledges every submit without decoding (the benchmark times transport)."""

    def __init__(self) -> None:
        self.theta = torch.zeros(1)

    async def assign(self, request: AssignRequest, peer_id: str) -> LeaseReply:
        return LeaseReply(None, "benchmark")

    async def get_model(self, version: Optional[int], peer_id: str) -> Tuple[int, torch.Tensor]:
        return 0, self.theta

    async def submit(self, header: SubmitHeader, pseudo_gradient: EncodedTensor, peer_id: str, upload_seconds: float = 0.0) -> Ack:
        return Ack(True, 0, "", False)


async def _raw_upload_handler(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while len(await P2P.receive_raw_data(reader)) > 0:
            pass
        writer.write(b"\x01")
        await writer.drain()
        await read_until_closed(reader, 30.0, 1 << 20)  # the caller closes once it has read the byte
    finally:
        writer.close()


async def _raw_download_handler(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        total = int.from_bytes(await reader.readexactly(8), "big")
        chunk = bytes(min(CHUNK_BYTES, total))
        for offset in range(0, total, CHUNK_BYTES):
            await P2P.send_raw_data(chunk[: min(CHUNK_BYTES, total - offset)], writer)
        # hang up only once the caller has read it all and closed (as the service does: closing first lets p2pd reset
        # the stream, and the reset overtook the last chunk on a loaded machine — "262144 of 400000 bytes")
        await read_until_closed(reader, 30.0, 1 << 20)
    finally:
        writer.close()


async def raw_upload(client: P2P, server: P2P, nbytes: int) -> None:
    _, reader, writer = await client.call_binary_stream_handler(server.peer_id, RAW_UPLOAD)
    try:
        chunk = bytes(min(CHUNK_BYTES, nbytes))
        for offset in range(0, nbytes, CHUNK_BYTES):
            await P2P.send_raw_data(chunk[: min(CHUNK_BYTES, nbytes - offset)], writer)
        await P2P.send_raw_data(b"", writer)
        await reader.readexactly(1)
    finally:
        writer.close()


async def raw_download(client: P2P, server: P2P, nbytes: int) -> None:
    _, reader, writer = await client.call_binary_stream_handler(server.peer_id, RAW_DOWNLOAD)
    try:
        writer.write(nbytes.to_bytes(8, "big"))
        await writer.drain()
        received = 0
        while received < nbytes:
            received += len(await P2P.receive_raw_data(reader))
    finally:
        writer.close()


async def fresh_download(service: CoordinatorService, client: CoordinatorClient, codec: str) -> None:
    """A full download as a peer without θ sees it: no held version, no cached encoding."""
    client.held = None
    service._model_cache.clear()
    await client.get_model(codec=codec)


async def best_of(repeats: int, make: Callable[[], Awaitable[Any]]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        await make()
        best = min(best, time.perf_counter() - start)
    return best


def time_codec(codec: str, tensor: torch.Tensor, repeats: int) -> Tuple[EncodedTensor, float, float]:
    encode_s = decode_s = float("inf")
    encoded = encode(codec, tensor)
    for _ in range(repeats):
        start = time.perf_counter()
        encoded = encode(codec, tensor)
        encode_s = min(encode_s, time.perf_counter() - start)
        start = time.perf_counter()
        decode(encoded, tensor.numel())
        decode_s = min(decode_s, time.perf_counter() - start)
    return encoded, encode_s, decode_s


async def run(sizes: List[int], repeats: int) -> List[Row]:
    rows: List[Row] = []
    server = client_p2p = None
    try:
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs())
        await server.add_binary_stream_handler(RAW_UPLOAD, _raw_upload_handler)
        await server.add_binary_stream_handler(RAW_DOWNLOAD, _raw_download_handler)
        for numel in sizes:
            handler = BenchHandler()
            handler.theta = torch.randn(numel, generator=torch.Generator().manual_seed(0))
            service = CoordinatorService(handler, numel, model_codecs=MODEL_CODECS, max_concurrent_submits=1)
            namespace = f"bench{numel}"
            await service.add_p2p_handlers(server, namespace=namespace)
            client = CoordinatorClient(client_p2p, server.peer_id, numel, namespace=namespace)
            pseudo_gradient = torch.randn(numel, generator=torch.Generator().manual_seed(1))
            # Warm up: the first stream to a namespace opens libp2p streams and imports bitsandbytes.
            await client.submit("warmup", 0, encode("bf16", pseudo_gradient))
            await raw_upload(client_p2p, server, wire_bytes("bf16", numel))
            for codec in CODECS:
                encoded, encode_s, decode_s = time_codec(codec, pseudo_gradient, repeats)
                nbytes = wire_bytes(codec, numel)
                upload_s = await best_of(repeats, lambda: client.submit("bench", 0, encoded))
                raw_upload_s = await best_of(repeats, lambda: raw_upload(client_p2p, server, nbytes))
                download_s = raw_download_s = None
                if codec in MODEL_CODECS:
                    download_s = await best_of(repeats, lambda: fresh_download(service, client, codec))
                    raw_download_s = await best_of(repeats, lambda: raw_download(client_p2p, server, nbytes))
                row = Row(numel, codec, nbytes / 1e6, encode_s, decode_s, upload_s, raw_upload_s, download_s, raw_download_s)
                logger.info("%s", row)
                rows.append(row)
            await service.remove_p2p_handlers(server, namespace=namespace)
    finally:
        for p2p in (client_p2p, server):
            if p2p is not None:
                await p2p.shutdown()
    return rows


def markdown(rows: List[Row]) -> str:
    def mbps(row: Row, seconds: Optional[float]) -> str:
        return "-" if seconds is None else f"{row.wire_mb / seconds:.0f}"

    def ratio(rpc: Optional[float], raw: Optional[float]) -> str:
        return "-" if rpc is None or raw is None else f"{raw / rpc:.2f}"

    lines = [
        "| floats | codec | wire MB | encode s | decode s | submit MB/s | raw up MB/s | submit/raw "
        "| get_model MB/s | raw down MB/s | get_model/raw |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.numel / 1e6:g}M | {row.codec} | {row.wire_mb:.1f} | {row.encode_s:.3f} | {row.decode_s:.3f} "
            f"| {mbps(row, row.upload_s)} | {mbps(row, row.raw_upload_s)} | {ratio(row.upload_s, row.raw_upload_s)} "
            f"| {mbps(row, row.download_s)} | {mbps(row, row.raw_download_s)} "
            f"| {ratio(row.download_s, row.raw_download_s)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes 1M and 4M floats, 2 repeats (~30 s)")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 2.5e7], help="numbers of floats")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per figure")
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: 100k floats, 1 repeat (tests)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sizes, repeats = ([1_000_000, 4_000_000], 2) if args.quick else ([int(size) for size in args.sizes], args.repeats)
    if args.smoke:
        sizes, repeats = [100_000], 1
    start = time.perf_counter()
    rows = asyncio.run(run(sizes, repeats))
    print(markdown(rows))
    print(f"\n(total {time.perf_counter() - start:.0f} s; ratio = RPC throughput / raw stream throughput)")
    if args.json:
        with open(args.json, "w") as file:
            json.dump([asdict(row) for row in rows], file, indent=1)


if __name__ == "__main__":
    main()
