"""θ downloads that send a peer only what it lacks, without accumulating codec error.

A lossy download codec (bf16, fp16, int8, int4) gives the peer ``F_v = decode(encode(θ_v))``, which
differs from the coordinator's θ_v by one encoding's error. A naive delta — the peer adds
``decode(encode(θ_v − θ_u))`` to what it already holds — would add a new encoding error every round.
Instead every delta is taken against an **anchor**: a full encoding ``F_a`` that the peer holds
bit for bit (it decoded the same bytes the coordinator keeps). The coordinator sends
``encode(θ_v − F_a)`` and the peer sets ``θ̂_v = F_a + decode(encode(θ_v − F_a))``, so

    |θ̂_v − θ_v| = |decode(encode(d)) − d|  with  d = θ_v − F_a,

exactly one encoding's error of the (small) delta ``d``, whatever chain of downloads came before:
nothing telescopes, nothing accumulates. The coordinator sends a delta only while its closed-form
error bound (:func:`error_bound` of ``max|d|``) is at most that of a full encoding of θ_v; otherwise it
sends θ_v in full, which becomes a new anchor. An int8 (or bf16) delta costs exactly the bytes of a
full int8 (bf16) θ: the gain is accuracy, not bytes. ``none`` (fp32) downloads are exact and always
full (an fp32 delta would cost the same bytes and add a rounding).

Memory is bounded and independent of the number of peers: the coordinator keeps at most
``max_anchors`` encoded anchors (LRU, ``wire_bytes(codec, numel)`` each), ``max_bodies`` encoded delta
bodies, and one decoded anchor. A peer names its anchor in the request; an unknown anchor (never
served, or evicted) simply gets a full θ. See docs/transport.md ("Downloads").

Durable anchors (:meth:`AnchorStore.persist`): the coordinator writes each anchor it creates to its checkpoint
directory (write to a temporary file, ``fsync``, rename; evicted ones deleted) and a ``--resume`` loads them back, so
that a check whose peer trained from a delta can still rebuild that peer's θ after a restart (:func:`decoded_theta`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional, Tuple

import torch

from asyncloco.durable import write_durably
from asyncloco.transport.codecs import CODECS, EncodedTensor, decode, encode, wire_bytes
from asyncloco.transport.errors import CodecError

logger = logging.getLogger(__name__)

__all__ = ["DELTA_CODECS", "relative_error", "error_bound", "Served", "AnchorStore", "apply_delta", "decoded_theta", "theta_digest",
           "ANCHOR_FILE_HEADER"]

DELTA_CODECS: tuple[str, ...] = ("fp16", "bf16", "int8", "int4")  # lossy: deltas against an anchor
_FP32_ADD = 2.0**-23  # relative rounding of the peer's fp32 addition F_a + decode(delta), with margin
_relative: dict[str, float] = {}
# a durable anchor's file (AnchorStore.persist): this magic, the sha256 of the body, then the body
_ANCHOR_MAGIC = b"ALANCHR1"
ANCHOR_FILE_HEADER = len(_ANCHOR_MAGIC) + 32
_ANCHOR_NAME = re.compile(r"^(?P<codec>[a-z0-9]+)-(?P<version>[0-9]{1,19})\.bin$")


def relative_error(codec: str) -> float:
    """Closed-form bound of ``max|decode(encode(x)) − x| / max|x|`` for codec ``codec``.

    int8/int4: the widest step of the code book (each value is scaled by its block's absmax, at most
    ``max|x|``, into [-1, 1] and looked up in the code book; bitsandbytes' CPU lookup for int8 is not
    exactly round-to-nearest — its measured worst is 0.502 of the widest step — so the bound is one whole
    step, not half); bf16: half an ulp, 2⁻⁸ of the value (8 significant bits); fp16: 2⁻¹¹
    (subnormals are covered by :func:`error_bound`'s absolute term); none: 0.
    """
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if codec not in _relative:
        if codec == "none":
            value = 0.0
        elif codec == "bf16":
            value = 2.0**-8
        elif codec == "fp16":
            value = 2.0**-11
        else:
            import bitsandbytes.functional as bnbf  # lazily: it logs a kernel notice at import on CPU

            if codec == "int8":
                code = bnbf.create_dynamic_map().to(torch.float64)
            else:
                code = bnbf.get_4bit_type("nf4", device="cpu").to(torch.float64)
            code = code.sort().values
            value = max(float(code.diff().max()), 1.0 + float(code[0]), 1.0 - float(code[-1]))
        _relative[codec] = value
    return _relative[codec]


def error_bound(codec: str, max_abs: float) -> float:
    """Closed-form bound of the max-abs error of encoding a vector whose largest magnitude is
    ``max_abs`` with ``codec`` (with a margin of 10⁻⁵ relative for the fp32 arithmetic of the scales)."""
    absolute = 2.0**-25 if codec == "fp16" else 0.0  # fp16 subnormal step / 2
    return relative_error(codec) * max_abs * (1 + 1e-5) + absolute


def _max_abs(tensor: torch.Tensor) -> float:
    return float(tensor.abs().max()) if tensor.numel() else 0.0


@dataclass(frozen=True)
class Served:
    """What the coordinator sends for one download: the stream ``body`` (exactly
    ``wire_bytes(codec, numel)`` bytes), ``delta_from`` (the anchor version it is a delta from, ``None``
    for a full θ) and ``bound``: the closed-form max-abs error of what the peer will then hold vs θ_v."""

    delta_from: Optional[int]
    body: Any
    bound: float


def apply_delta(codec: str, numel: int, anchor_body: Any, delta_body: Any) -> torch.Tensor:
    """The peer's side: ``decode(anchor) + decode(delta)`` — the same operations, in the same order, as
    the coordinator uses to compute its bound."""
    anchor = decode(EncodedTensor.from_bytes(codec, numel, anchor_body), numel)
    anchor += decode(EncodedTensor.from_bytes(codec, numel, delta_body), numel)
    return anchor


def theta_digest(theta: torch.Tensor) -> str:
    """sha256 (hex) of θ's fp32 bytes: what a peer commits to as the θ it decoded and trained from (the submission's
    ``theta_digest``), and what the verifier checks its reconstruction against (coordinator/rerun.py)."""
    import hashlib

    return hashlib.sha256(theta.detach().to(torch.float32).contiguous().cpu().numpy().view("u1").data).hexdigest()


def decoded_theta(codec: str, theta: torch.Tensor, anchor_body: Optional[bytes]) -> torch.Tensor:
    """The θ a peer holds after downloading ``theta`` (θ_v, fp32) in ``codec``: exactly θ_v for ``none``; for a lossy
    codec ``decode(encode(θ_v))`` when it came in full (``anchor_body`` None: from the coordinator or the swarm, whose
    seed sends the same encoding), else ``F_a + decode(encode(θ_v − F_a))`` with ``F_a`` the anchor's full encoding
    ``anchor_body`` — the coordinator's and the peer's own operations (:meth:`AnchorStore._delta`, :func:`apply_delta`),
    bit for bit. The verifier re-runs a lease from it (docs/design.md, "Compressed downloads and verification")."""
    numel = theta.numel()
    if codec == "none":
        if anchor_body is not None:
            raise CodecError("an fp32 download is never a delta")
        return theta
    if codec not in DELTA_CODECS:
        raise CodecError(f"unknown download codec {codec!r}")
    if anchor_body is None:
        return decode(EncodedTensor.from_bytes(codec, numel, encode(codec, theta).to_bytes()), numel)
    delta = torch.sub(theta, decode(EncodedTensor.from_bytes(codec, numel, anchor_body), numel))
    return apply_delta(codec, numel, anchor_body, encode(codec, delta).to_bytes())


class AnchorStore:
    """The coordinator's side of delta downloads for the lossy codecs (thread-safe; CPU-heavy calls,
    run them off the event loop).

    :param numel: the model size.
    :param max_anchors: full encodings kept as anchors per store (LRU over all codecs).
    :param max_bodies: encoded delta bodies kept by (version, codec, anchor) for repeated downloads.
    """

    def __init__(self, numel: int, max_anchors: int = 4, max_bodies: int = 4) -> None:
        wire_bytes("none", numel)  # validates numel
        if max_anchors < 1 or max_bodies < 0:
            raise ValueError(f"max_anchors must be ≥ 1 and max_bodies ≥ 0, got {max_anchors}, {max_bodies}")
        self.numel, self.max_anchors, self.max_bodies = numel, max_anchors, max_bodies
        self._anchors: OrderedDict[Tuple[str, int], bytes] = OrderedDict()  # (codec, version) -> full body
        self._bodies: OrderedDict[Tuple[str, int, int], Served] = OrderedDict()
        self._decoded: Optional[Tuple[Tuple[str, int], torch.Tensor]] = None  # one decoded anchor F_a
        self._lock = threading.Lock()
        self._dir: Optional[Path] = None  # where anchors are kept durably (persist), if anywhere
        self.full_sent = 0  # counters (tests, status)
        self.deltas_sent = 0

    def anchors(self) -> list[Tuple[str, int]]:
        with self._lock:
            return list(self._anchors)

    def persist(self, directory: Path, *, load: bool) -> int:
        """From now on keep every anchor this store creates in ``directory`` too, one file each
        (``<codec>-<version>.bin``: a magic, the body's sha256, the body), written atomically (a temporary file,
        ``fsync``, rename, ``fsync`` of the directory) before the body is served, and deleted when evicted.

        ``load`` (``--resume``): first take back the anchors found there, newest ``max_anchors`` by version, each
        checked for its size (``wire_bytes(codec, numel)`` plus the header, before it is read) and its digest; a file that
        fails either is ignored with a warning and deleted, as are the older ones beyond ``max_anchors``. Without
        ``load`` (a new run) whatever is there is deleted: anchors of another run would name other θs. Never raises
        for the files' contents or the disk (a failure costs durability, logged, not the downloads). Returns the
        number of anchors loaded."""
        directory = Path(directory)
        with self._lock:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                found = sorted(directory.iterdir())
            except OSError as error:
                logger.warning("download anchors cannot be kept in %s (%r); a restart forgets them", directory, error)
                return 0
            self._dir = directory
            candidates: list[Tuple[int, str, Path]] = []
            for path in found:
                match = _ANCHOR_NAME.match(path.name)
                if load and match is not None and match["codec"] in DELTA_CODECS:
                    candidates.append((int(match["version"]), match["codec"], path))
                elif match is not None or path.name.endswith(".tmp"):
                    _unlink(path)  # another run's anchor, or a write a crash interrupted
            loaded = 0
            for version, codec, path in sorted(candidates, reverse=True):  # newest first
                body = self._read_anchor(path, codec) if loaded < self.max_anchors else None
                if body is None:
                    _unlink(path)
                    continue
                self._anchors[(codec, version)] = body
                self._anchors.move_to_end((codec, version), last=False)  # the newest ends most recently used
                loaded += 1
            if loaded:
                logger.info("%d download anchor(s) loaded from %s: %s", loaded, directory,
                            ", ".join(f"{codec} v{version}" for codec, version in self._anchors))
            return loaded

    def _read_anchor(self, path: Path, codec: str) -> Optional[bytes]:
        """An anchor file's body once its size and digest check out, else None (with a warning)."""
        expected = ANCHOR_FILE_HEADER + wire_bytes(codec, self.numel)
        try:
            size = path.stat().st_size
            if size != expected:
                raise ValueError(f"{size} bytes, expected {expected} for {codec} θ of {self.numel} elements")
            with open(path, "rb") as handle:
                data = handle.read(expected + 1)
            if len(data) != expected:
                raise ValueError(f"read {len(data)} bytes, expected {expected}")
            if data[: len(_ANCHOR_MAGIC)] != _ANCHOR_MAGIC:
                raise ValueError("not an anchor file")
            body = data[ANCHOR_FILE_HEADER:]
            if hashlib.sha256(body).digest() != data[len(_ANCHOR_MAGIC) : ANCHOR_FILE_HEADER]:
                raise ValueError("its body does not match its digest")
            return body
        except (OSError, ValueError) as error:
            logger.warning("download anchor %s ignored: %s", path, error)
            return None

    def _write_anchor(self, codec: str, version: int, body: bytes) -> None:
        """Write one anchor durably (persist); a failure is logged and the anchor kept in memory only."""
        if self._dir is None:
            return
        def write(handle: BinaryIO) -> None:
            handle.write(_ANCHOR_MAGIC)
            handle.write(hashlib.sha256(body).digest())
            handle.write(body)

        try:
            write_durably(self._dir / f"{codec}-{version}.bin", write)
        except OSError as error:
            logger.warning("download anchor %s v%d not written to %s (%r): a check of a delta from it cannot be "
                           "re-run after a restart", codec, version, self._dir, error)

    def anchor_body(self, codec: str, version: int) -> Optional[bytes]:
        """The full encoding of θ at ``version`` in ``codec`` that deltas from it were taken against (None when this
        store does not keep it); the verifier reconstructs a peer's θ from it (:func:`decoded_theta`)."""
        with self._lock:
            return self._anchors.get((codec, version))

    def serve(self, version: int, codec: str, theta: torch.Tensor, anchor: Optional[int]) -> Served:
        """The body for a peer that asks for θ at ``version`` (``theta``, never mutated) in ``codec`` and
        holds the full encoding of ``anchor`` (``None``: none). A delta when this store still keeps that
        anchor and the delta's error bound is at most a full encoding's, else the full θ (a new anchor)."""
        if codec not in DELTA_CODECS:
            raise CodecError(f"delta downloads are for the lossy codecs {DELTA_CODECS}; {codec!r} is sent in full")
        if theta.numel() != self.numel:
            raise CodecError(f"θ has {theta.numel()} elements, the store expects {self.numel}")
        with self._lock:
            if anchor is not None and anchor != version and (codec, anchor) in self._anchors:
                cached = self._bodies.get((codec, version, anchor))
                if cached is not None:
                    self._bodies.move_to_end((codec, version, anchor))
                    self._anchors.move_to_end((codec, anchor))
                    self.deltas_sent += 1
                    return cached
                served = self._delta(version, codec, theta, anchor)
                if served is not None:
                    self._remember_body((codec, version, anchor), served)
                    self.deltas_sent += 1
                    return served
            self.full_sent += 1
            return self._full(version, codec, theta)

    def _full(self, version: int, codec: str, theta: torch.Tensor) -> Served:
        key = (codec, version)
        body = self._anchors.get(key)
        if body is None:
            body = encode(codec, theta).to_bytes()
            self._write_anchor(codec, version, body)  # durable before any peer holds it (persist)
            self._anchors[key] = body
            while len(self._anchors) > self.max_anchors:
                evicted, _ = self._anchors.popitem(last=False)
                self._bodies = OrderedDict((k, v) for k, v in self._bodies.items() if (k[0], k[2]) != evicted)
                if self._dir is not None:
                    _unlink(self._dir / f"{evicted[0]}-{evicted[1]}.bin")
                logger.debug("download anchor %s v%d evicted", evicted[0], evicted[1])
        self._anchors.move_to_end(key)
        return Served(None, body, error_bound(codec, _max_abs(theta)))

    def _anchor_values(self, codec: str, anchor: int) -> torch.Tensor:
        key = (codec, anchor)
        if self._decoded is None or self._decoded[0] != key:
            self._decoded = None  # free the previous one before allocating the next
            self._decoded = (key, decode(EncodedTensor.from_bytes(codec, self.numel, self._anchors[key]), self.numel))
        return self._decoded[1]

    def _delta(self, version: int, codec: str, theta: torch.Tensor, anchor: int) -> Optional[Served]:
        delta = torch.sub(theta, self._anchor_values(codec, anchor))
        delta_max, theta_max = _max_abs(delta), _max_abs(theta)
        full = error_bound(codec, theta_max)
        bound = error_bound(codec, delta_max) + _FP32_ADD * (theta_max + 2 * delta_max)
        if not math.isfinite(bound) or bound > full:
            logger.debug("v%d from anchor v%d: delta bound %.3g > full %.3g; sending θ in full", version, anchor, bound, full)
            return None
        self._anchors.move_to_end((codec, anchor))
        return Served(anchor, encode(codec, delta).to_bytes(), bound)

    def _remember_body(self, key: Tuple[str, int, int], served: Served) -> None:
        if self.max_bodies == 0:
            return
        self._bodies[key] = served
        while len(self._bodies) > self.max_bodies:
            self._bodies.popitem(last=False)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        logger.warning("could not delete %s (%r)", path, error)
