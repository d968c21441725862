#!/usr/bin/env bash
# Download, here, the wheels that the GPU machine's image lacks (docs/gpu.md): CPython 3.12, manylinux x86_64,
# into .whl-gpu/ (ignored by git). The device machine reaches no registry, so scripts/gpu_check.py installs
# them from there with `pip install --no-index --no-deps --target` (its --wheels option).
#
#   bash scripts/gpu_wheels.sh        # about 2 min; then `du -sh .whl-gpu` (about 24 MB) and docs/gpu.md
#
# Versions are the ones this checkout's environment runs (pip show), so the GPU machine runs the same code.
# bitsandbytes' wheel (43 MB) holds a kernel library per CUDA, ROCm and XPU release; the GPU image's torch is
# built for CUDA 13, so the copy made here keeps only the CUDA 13.x and CPU libraries (about 3 MB): with it the
# whole set travels in one device call under the 64 MiB limit. Set GPU_WHEELS_FULL_BNB=1 to keep it whole.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl-gpu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
           --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform any)
download() {  # folder, then name==version ...
    local folder=$1; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --abi cp312 --abi abi3 --abi none "${platforms[@]}" -d "$folder" "$@"
}
version() { python3 -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
pin() { local v; v=$(version "$1"); echo "$1${v:+==$v}"; }

# hivemind and what it imports that the image lacks (its grpcio-tools requirement is never imported)
base=(hivemind base58 configargparse netaddr prefetch_generator varint py-cid py-multihash py-multibase
      py-multicodec python-baseconv morphys blake3 mmh3
      cryptography cffi pycparser
      pydantic pydantic-core annotated-types typing-inspection
      datasets dill multiprocess)
for name in "${base[@]}"; do
    spec=$(pin "$name")
    if ! download "$out" "$spec" 2>/dev/null; then
        # sdist only on PyPI (prefetch_generator, varint, ...): pure Python, so a wheel built here runs there
        python3 -m pip wheel -q --no-deps --no-binary=:all: -w "$out" "$spec"
    fi
done
download "$tmp" "$(pin bitsandbytes)"
if [ "${GPU_WHEELS_FULL_BNB:-0}" = 1 ]; then
    cp "$tmp"/bitsandbytes-*.whl "$out"/
else
    python3 - "$tmp" "$out" <<'PY'
import sys, zipfile
from pathlib import Path

source = next(Path(sys.argv[1]).glob("bitsandbytes-*.whl"))
target = Path(sys.argv[2]) / source.name
def unwanted(name: str) -> bool:  # kernel libraries for another CUDA, ROCm or XPU release
    lib = name.rsplit("/", 1)[-1]
    return lib.startswith("libbitsandbytes_") and not lib.startswith(("libbitsandbytes_cuda13", "libbitsandbytes_cpu"))
with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if unwanted(item.filename):
            continue
        data = zin.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if not unwanted(line.split(b",", 1)[0].decode()))
        zout.writestr(item, data)
print(f"{target.name}: {source.stat().st_size / 1e6:.1f} MB -> {target.stat().st_size / 1e6:.1f} MB (CUDA 13.x + CPU kernels)")
PY
fi
for built in "$out"/*.whl; do
    case "$built" in
        *-none-any.whl|*-none-manylinux*x86_64.whl|*cp312*|*abi3*) ;;
        *) echo "gpu_wheels: $built is not for CPython 3.12 / x86_64; remove it and download it by hand" >&2; exit 1 ;;
    esac
done
du -sh "$out"
ls -la "$out" | awk 'NR > 3 {print $5, $9}'
