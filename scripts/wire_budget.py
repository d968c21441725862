"""Bytes on the wire per round (pseudo-gradient up + θ down) per codec pair, exact from ``wire_bytes``.

``python scripts/wire_budget.py [--preset 150m] [--vocab-size N] [--json out.json]`` prints a Markdown
table: for each (upload codec, download codec) the payload bytes of one round and their fraction of
fp32 up + fp32 down. Framing adds 5 bytes per 1 MiB chunk plus two small headers per transfer
(docs/transport.md), under 0.001 % at these sizes, and is left out. A round whose lease starts from the
version the peer already holds downloads nothing (the "held" column).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List

from asyncloco.models.presets import count_parameters
from asyncloco.transport.codecs import wire_bytes

UPLOADS = ("none", "bf16", "int8", "int4")
DOWNLOADS = ("none", "bf16", "int8")


def table(numel: int) -> List[Dict[str, Any]]:
    fp32_round = 2 * wire_bytes("none", numel)
    rows = []
    for up in UPLOADS:
        for down in DOWNLOADS:
            up_b, down_b = wire_bytes(up, numel), wire_bytes(down, numel)
            rows.append({
                "upload": up, "download": down, "up_bytes": up_b, "down_bytes": down_b,
                "fraction": (up_b + down_b) / fp32_round, "fraction_held": up_b / fp32_round,
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="150m")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the preset's")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    numel = count_parameters(args.preset, args.vocab_size)
    rows = table(numel)
    print(f"preset {args.preset}: {numel:,} parameters; fp32 θ = {wire_bytes('none', numel) / 1e6:.1f} MB\n")
    print("| upload | download | up MB | down MB | up + down vs fp32 | if the peer holds θ |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['upload']} | {row['download']} | {row['up_bytes'] / 1e6:.1f} | {row['down_bytes'] / 1e6:.1f} | "
              f"{row['fraction']:.4f} | {row['fraction_held']:.4f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"preset": args.preset, "numel": numel, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
