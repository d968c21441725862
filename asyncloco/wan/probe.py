"""Measure a path: round-trip time and bulk TCP throughput each way (``python -m asyncloco.wan.probe``).

``serve --port P``: for each connection, one command line then data:
``ping`` echoes 1-byte messages; ``sink N`` reads N bytes and answers ``ok``; ``source N`` sends N bytes.
``measure --host H --port P``: prints a JSON object ``{"rtt_s": [...], "up_mbit": x, "down_mbit": y}``
(throughput excluding one round trip of the request/answer)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Optional

__all__ = ["serve", "measure", "main"]

BLOCK = 65536


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        command = (await reader.readline()).decode().split()
        if command == ["ping"]:
            while data := await reader.read(1):
                writer.write(data)
                await writer.drain()
        elif len(command) == 2 and command[0] == "sink":
            await reader.readexactly(int(command[1]))
            writer.write(b"ok\n")
            await writer.drain()
        elif len(command) == 2 and command[0] == "source":
            left = int(command[1])
            block = bytes(BLOCK)
            while left > 0:
                writer.write(block[: min(left, BLOCK)])
                left -= min(left, BLOCK)
                await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def serve(host: str, port: int) -> None:
    server = await asyncio.start_server(_handle, host, port)
    async with server:
        await server.serve_forever()


async def measure(host: str, port: int, up_bytes: int, down_bytes: int, pings: int) -> dict[str, object]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"ping\n")
    rtts = []
    for _ in range(pings):
        started = time.monotonic()
        writer.write(b"x")
        await writer.drain()
        await reader.readexactly(1)
        rtts.append(time.monotonic() - started)
    writer.close()
    rtt = statistics.median(rtts) if rtts else 0.0
    result: dict[str, object] = {"rtt_s": rtts}
    if up_bytes:
        reader, writer = await asyncio.open_connection(host, port)
        started = time.monotonic()
        writer.write(f"sink {up_bytes}\n".encode())
        block = bytes(BLOCK)
        left = up_bytes
        while left > 0:
            writer.write(block[: min(left, BLOCK)])
            left -= min(left, BLOCK)
            await writer.drain()
        await reader.readline()
        elapsed = time.monotonic() - started
        writer.close()
        result["up_mbit"] = up_bytes * 8 / 1e6 / max(1e-6, elapsed - rtt)
    if down_bytes:
        reader, writer = await asyncio.open_connection(host, port)
        started = time.monotonic()
        writer.write(f"source {down_bytes}\n".encode())
        await writer.drain()
        await reader.readexactly(down_bytes)
        elapsed = time.monotonic() - started
        writer.close()
        result["down_mbit"] = down_bytes * 8 / 1e6 / max(1e-6, elapsed - rtt)
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncloco.wan.probe", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    server = sub.add_parser("serve")
    server.add_argument("--host", default="0.0.0.0")
    server.add_argument("--port", type=int, required=True)
    client = sub.add_parser("measure")
    client.add_argument("--host", required=True)
    client.add_argument("--port", type=int, required=True)
    client.add_argument("--up-bytes", type=int, default=2_000_000)
    client.add_argument("--down-bytes", type=int, default=2_000_000)
    client.add_argument("--pings", type=int, default=5)
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            asyncio.run(serve(args.host, args.port))
        except KeyboardInterrupt:
            pass
        return 0
    result = asyncio.run(measure(args.host, args.port, args.up_bytes, args.down_bytes, args.pings))
    sys.stdout.write(json.dumps(result) + "\n")  # the command's result, for the caller to parse
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
