"""Compiled decoding kernels, built at first use with the machine's C compiler and called through ctypes.

The sign codecs' decoder (asyncloco/transport/codecs_sign.py) has a reference in numpy; at 150m it costs the
coordinator more than int8's, whose decoder is bitsandbytes' fused C loop (docs/compression.md, "What decoding
costs the coordinator"). ``asyncloco/transport/kernels/sign_decode.c`` does the same work in one pass. It is
compiled once per machine with ``cc -O3`` (≈ 0.2 s) into a cache directory, keyed by the source's hash, the
compiler and the platform; a concurrent first use from several processes is serialised by a file lock and an
atomic rename. Without a compiler, or with ``ASYNCLOCO_NATIVE=0``, the numpy decoder is used (same values, bit for
bit: tests/test_transport_native.py), and one log line says so.

ctypes releases the GIL during the call, so the caller's thread pool decodes disjoint ranges of blocks at once.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SIGN_SOURCE = KERNELS / "sign_decode.c"
FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-fno-strict-aliasing"]
COMPILE_TIMEOUT_S = 120.0

_lock = threading.Lock()
_sign: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
_tried = False


def cache_dir() -> Path:
    """Where compiled kernels live: ``$ASYNCLOCO_CACHE`` or ``$XDG_CACHE_HOME/asyncloco`` (``~/.cache/asyncloco``)."""
    explicit = os.environ.get("ASYNCLOCO_CACHE")
    if explicit:
        return Path(explicit) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asyncloco" / "kernels"


def enabled() -> bool:
    """False when ``ASYNCLOCO_NATIVE=0`` asks for the numpy decoders."""
    return os.environ.get("ASYNCLOCO_NATIVE", "1").strip() not in ("0", "false", "no", "off")


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc``/``gcc``/``clang`` on the PATH."""
    for name in ([os.environ["CC"]] if os.environ.get("CC") else []) + ["cc", "gcc", "clang"]:
        found = shutil.which(name)
        if found:
            return found
    return None


def build(source: Path, directory: Path | None = None) -> Path:
    """Compile ``source`` into a shared library in the cache (or return the one already there). Raises
    ``RuntimeError`` naming the compiler's complaint when it fails."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on the PATH; set CC or install one (e.g. apt-get install gcc)")
    text = source.read_bytes()
    key = hashlib.sha256(text + cc.encode() + " ".join(FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f".{source.stem}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # another process may be compiling the same kernel
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([cc, *FLAGS, "-o", str(built), str(source)], capture_output=True, text=True,
                                    timeout=COMPILE_TIMEOUT_S)
            if result.returncode != 0:
                raise RuntimeError(f"compiling {source.name} with {cc} failed: {result.stderr.strip()[-2000:]}")
            os.replace(built, target)
    return target


def sign_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The compiled sign decoder, or None (no compiler, a failed build, or ``ASYNCLOCO_NATIVE=0``)."""
    global _sign, _tried
    if not enabled():
        return None
    if _tried:
        return _sign
    with _lock:
        if not _tried:
            try:
                library = ctypes.CDLL(str(build(SIGN_SOURCE)))
                function = library.asyncloco_sign_decode
                function.restype = ctypes.c_int
                function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_int]
                _sign = function
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("the compiled sign decoder is not available (%s); decoding with numpy instead", exc)
            _tried = True
    return _sign


def sign_decode_blocks(kernel: ctypes._CFuncPtr, packed: np.ndarray, out: np.ndarray, scales: np.ndarray,  # type: ignore[name-defined]
                       p: int, q: int, rotation: int) -> None:
    """Decode ``len(scales)`` whole 512-value blocks: ``packed`` their sign bits (uint8, C-contiguous), ``out``
    (float32, C-contiguous, 512 per block) written, ``scales`` float32 (checked finite and ≥ 0 by the caller)."""
    blocks = scales.shape[0]
    if out.shape[0] != blocks * 512 or packed.shape[0] != blocks * 512 * p // q // 8:
        raise ValueError(f"sign kernel: {blocks} blocks need {blocks * 512} values and {blocks * 512 * p // q // 8} "
                         f"bytes, got {out.shape[0]} and {packed.shape[0]}")
    for array, dtype in ((packed, np.uint8), (out, np.float32), (scales, np.float32)):
        if array.dtype != dtype or not array.flags.c_contiguous:
            raise ValueError(f"sign kernel: expected a C-contiguous {np.dtype(dtype)} array, got {array.dtype}")
    if not out.flags.writeable:
        raise ValueError("sign kernel: the output array is read-only")
    status = kernel(packed.ctypes.data, out.ctypes.data, scales.ctypes.data, blocks, p, q, rotation)
    if status != 0:
        raise ValueError(f"sign kernel refused p={p} q={q} rotation={rotation}")
