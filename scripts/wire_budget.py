"""Bytes on the wire per round (pseudo-gradient up + θ down) per codec pair, exact from ``wire_bytes``.

``python scripts/wire_budget.py [--preset 150m] [--vocab-size N] [--json out.json]`` prints a Markdown
table: for each (upload codec, download codec) the payload bytes of one round and their fraction of
fp32 up + fp32 down. Framing adds 5 bytes per 1 MiB chunk plus two small headers per transfer
(docs/transport.md), under 0.001 % at these sizes, and is left out. A round whose lease starts from the
version the peer already holds downloads nothing (the "held" column).

A lossy download is a full encoding of θ or a delta from the peer's anchor (transport/delta.py): the same
bytes either way. The second table gives, per download codec, the closed-form bound of the max-abs error
of what the peer trains from: ``relative_error(codec) × max|θ|`` for a full download and
``relative_error(codec) × max|θ_v − F_a|`` for a delta; ``--delta-ratio`` (default: measured with
``--measure``) is ``max|θ_v − F_a| / max|θ|``. ``--measure`` builds the preset's model (fp32 θ in memory),
encodes θ once per download codec and reports the measured max-abs and relative L2 error of a full
download next to the bound.

The first table is the upload alone for every upload codec, including the 2-bit and sparse
ones meant for error feedback (docs/compression.md): bytes per round, the factor fewer than fp32, and the
minutes one upload takes at ``--uplink-mbit`` (default 10 Mbit/s, a common home uplink).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List

from asyncloco.models.presets import count_parameters
from asyncloco.transport.codecs import decode, encode, wire_bytes
from asyncloco.transport.delta import relative_error

UPLOADS = ("none", "bf16", "int8", "int4", "sgn15of16")  # sgn15of16: the shipped configs' upload
UPLOADS_EF = ("none", "bf16", "int8", "int4", "int2", "topk32b2", "grp4b2", "sgn1of1", "sgn15of16", "sgn7of8", "grp4b1",
              "topk16b4", "sgn3of4", "grp8b2", "topk16b2", "sgn5of8", "sgn1of2", "topk8b2", "topk4b2", "topk2b2")


def upload_table(numel: int, uplink_mbit: float) -> List[Dict[str, Any]]:
    """One upload per codec: exact bytes, × fewer than fp32, minutes at ``uplink_mbit`` Mbit/s."""
    fp32 = wire_bytes("none", numel)
    return [
        {"upload": up, "bytes": wire_bytes(up, numel), "x_fewer": fp32 / wire_bytes(up, numel),
         "minutes": wire_bytes(up, numel) * 8 / (uplink_mbit * 1e6) / 60}
        for up in UPLOADS_EF
    ]
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


def measure(preset: str, vocab_size: Any) -> Dict[str, Dict[str, float]]:
    """Encode the preset's initial θ once per lossy download codec: measured errors of a full download."""
    import torch

    from asyncloco.models.presets import build_causal_lm

    model = build_causal_lm(preset, vocab_size)
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach().float().contiguous()
    del model
    scale = float(theta.abs().max())
    out = {}
    for codec in DOWNLOADS[1:]:
        error = decode(encode(codec, theta), theta.numel()).sub_(theta)
        out[codec] = {
            "max_abs_theta": scale,
            "max_abs_error": float(error.abs().max()),
            "bound": relative_error(codec) * scale,
            "relative_l2": float(error.norm() / theta.norm()),
        }
        del error
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="150m")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the preset's")
    parser.add_argument("--json", default=None)
    parser.add_argument("--uplink-mbit", type=float, default=10.0, help="uplink for the upload-minutes column")
    parser.add_argument("--measure", action="store_true", help="build the model and measure full-download errors")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset, measured (tests)")
    args = parser.parse_args()
    if args.smoke:  # tiny has no default vocabulary: the project's tokenizer's 4096
        args.preset, args.vocab_size, args.measure = "tiny", args.vocab_size or 4096, True
    numel = count_parameters(args.preset, args.vocab_size)
    rows = table(numel)
    print(f"preset {args.preset}: {numel:,} parameters; fp32 θ = {wire_bytes('none', numel) / 1e6:.1f} MB\n")
    uploads = upload_table(numel, args.uplink_mbit)
    print(f"| upload codec | MB per round | × fewer than fp32 | minutes per upload at {args.uplink_mbit:g} Mbit/s |")
    print("|---|---:|---:|---:|")
    for up in uploads:
        print(f"| {up['upload']} | {up['bytes'] / 1e6:.2f} | {up['x_fewer']:.1f} | {up['minutes']:.2f} |")
    print()
    print("| upload | download | up MB | down MB | up + down vs fp32 | if the peer holds θ |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['upload']} | {row['download']} | {row['up_bytes'] / 1e6:.1f} | {row['down_bytes'] / 1e6:.1f} | "
              f"{row['fraction']:.4f} | {row['fraction_held']:.4f} |")
    print("\nθ download error bound (closed form, transport/delta.py) relative to max|θ| (full download) or to")
    print("max|θ_v − F_a| (delta from the anchor F_a); the bytes of a full download and of a delta are equal:\n")
    print("| download | MB | bound / max-abs value encoded |")
    print("|---|---:|---:|")
    for down in DOWNLOADS:
        print(f"| {down} | {wire_bytes(down, numel) / 1e6:.1f} | {relative_error(down):.4g} |")
    measured = measure(args.preset, args.vocab_size) if args.measure else {}
    if measured:
        print(f"\nmeasured on the {args.preset} preset's initial θ (max|θ| = {next(iter(measured.values()))['max_abs_theta']:.4g}):\n")
        print("| download | max-abs error (full) | its bound | relative L2 error |")
        print("|---|---:|---:|---:|")
        for codec, row in measured.items():
            print(f"| {codec} | {row['max_abs_error']:.3g} | {row['bound']:.3g} | {row['relative_l2']:.3g} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"preset": args.preset, "numel": numel, "rows": rows, "uploads": uploads, "uplink_mbit": args.uplink_mbit,
                       "relative_error": {down: relative_error(down) for down in DOWNLOADS}, "measured": measured}, handle, indent=1)


if __name__ == "__main__":
    main()
