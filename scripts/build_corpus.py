#!/usr/bin/env python
"""Rebuild the embedded English corpus ``asyncloco/data/corpus.jsonl.xz`` from Debian packages.

Sources (all public-domain texts, see ``asyncloco/data/CORPUS_LICENSE.md``):

* ``r-cran-janeaustenr`` — Jane Austen's six completed novels (one document per chapter). The text
  sits in an R lazy-load database (``Rdata.rdb``); a minimal reader for R's XDR serialization
  format is below, so R itself is not needed.
* ``jargon-text`` — The Jargon File 4.4.7 (one document per chapter / glossary entry).
* ``dict-devil`` — Ambrose Bierce, The Devil's Dictionary (one document per entry, dictd format).

Usage::

    python scripts/build_corpus.py                     # apt-get download into a temp dir
    python scripts/build_corpus.py --debs-dir /tmp/d   # reuse already downloaded .deb files

The output is one JSON object per line, ``{"source": ..., "title": ..., "text": ...}``, in a fixed
order (Austen by novel and chapter, then the Jargon File, then the Devil's Dictionary), xz-compressed
deterministically, so a rebuild from the same package versions is byte-identical.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import logging
import lzma
import os
import re
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path
from typing import Any

logger = logging.getLogger("build_corpus")

PACKAGES = ("r-cran-janeaustenr", "jargon-text", "dict-devil")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "asyncloco" / "data" / "corpus.jsonl.xz"
AUSTEN_TITLES = {  # the lazy-load database stores the novels in this (alphabetical object-name) order
    "EMMA": "Emma",
    "MANSFIELD PARK": "Mansfield Park",
    "NORTHANGER ABBEY": "Northanger Abbey",
    "Persuasion": "Persuasion",
    "PRIDE AND PREJUDICE": "Pride and Prejudice",
    "SENSE AND SENSIBILITY": "Sense and Sensibility",
}


# ----------------------------------------------------------------------------------------- R data
class _RUnserializer:
    """Just enough of R's XDR serialization format to read character vectors and data frames."""

    _SPECIAL = {254, 253, 252, 251, 250, 242, 241}  # NULL, global/empty/base env, missing arg, ...

    def __init__(self, raw: bytes) -> None:
        self.raw, self.pos, self.refs = raw, 0, []  # type: ignore[var-annotated]

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.raw, self.pos)
        self.pos += 4
        return int(value)

    def read(self) -> Any:
        if self.raw[:2] != b"X\n":
            raise ValueError("not an XDR-serialized R object")
        self.pos = 2
        version = self._int()
        self._int(), self._int()  # writer / minimal reader R versions
        if version == 3:
            encoding_length = self._int()  # native encoding name, skipped
            self.pos += encoding_length
        return self._item()

    def _item(self) -> Any:
        flags = self._int()
        sexp_type, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if sexp_type in self._SPECIAL:
            return None
        if sexp_type == 255:  # reference to an earlier symbol / environment
            index = flags >> 8 or self._int()
            return self.refs[index - 1]
        if sexp_type == 1:  # symbol
            symbol = ("symbol", self._item())
            self.refs.append(symbol)
            return symbol
        if sexp_type in (2, 6, 17, 239, 240):  # pairlists and language objects
            if has_attr:
                self._item()
            tag = self._item() if has_tag else None
            head, tail = self._item(), self._item()
            return [(tag, head)] + (tail if isinstance(tail, list) else [])
        if sexp_type == 9:  # CHARSXP
            length = self._int()
            if length == -1:
                return None
            text = self.raw[self.pos : self.pos + length].decode("utf-8")
            self.pos += length
            return text
        if sexp_type in (10, 13, 14, 16, 19, 20):  # logical, int, double, character, list, expr
            length = self._int()
            if sexp_type in (10, 13):
                values: Any = list(struct.unpack_from(f">{length}i", self.raw, self.pos))
                self.pos += 4 * length
            elif sexp_type == 14:
                values = list(struct.unpack_from(f">{length}d", self.raw, self.pos))
                self.pos += 8 * length
            else:
                values = [self._item() for _ in range(length)]
            if has_attr:
                self._item()
            return values
        raise ValueError(f"unsupported R object type {sexp_type} at byte {self.pos}")


def read_r_lazyload_db(path: Path) -> list[Any]:
    """All objects of an R ``.rdb`` lazy-load database, in file order (zlib chunks back to back)."""
    blob, offset, objects = path.read_bytes(), 0, []
    while offset < len(blob):
        (length,) = struct.unpack_from(">i", blob, offset)
        inflater = zlib.decompressobj()
        raw = inflater.decompress(blob[offset + 4 :])
        assert len(raw) == length, "R lazy-load chunk length mismatch"
        offset = len(blob) - len(inflater.unused_data)
        objects.append(_RUnserializer(raw).read())
    return objects


# --------------------------------------------------------------------------------- text cleaning
def reflow(lines: list[str]) -> str:
    """Join hard-wrapped prose paragraphs into single lines; keep indented blocks (verse) as is."""
    paragraphs: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            paragraphs[-1].append(line.rstrip())
        elif paragraphs[-1]:
            paragraphs.append([])
    out = []
    for para in paragraphs:
        if not para:
            continue
        if any(line[:1].isspace() for line in para):
            out.append("\n".join(para))
        else:
            out.append(" ".join(line.strip() for line in para))
    return "\n\n".join(out)


def austen_documents(package_root: Path) -> list[dict[str, str]]:
    rdb = next(package_root.glob("usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"))
    docs = []
    for lines in read_r_lazyload_db(rdb):
        title = AUSTEN_TITLES[lines[0]]
        chapters: list[list[str]] = [[]]
        for line in lines:
            if re.match(r"^\s*chapter\b", line, re.IGNORECASE):
                chapters.append([])
            chapters[-1].append(line.replace("_", ""))  # Gutenberg italics markers
        for number, chapter in enumerate(chapters):
            text = reflow(chapter)
            if len(text) > 200:  # drop title pages without prose
                docs.append({"source": "austen", "title": f"{title} ({number})", "text": text})
    return docs


def jargon_documents(package_root: Path) -> list[dict[str, str]]:
    raw = gzip.decompress(next(package_root.glob("usr/share/doc/jargon-text/jargon.txt.gz")).read_bytes())
    lines = raw.decode("utf-8").replace("\u00a0", " ").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Chapter 1."))
    docs: list[dict[str, str]] = []
    title, body = lines[start], []  # type: ignore[var-annotated]

    def flush() -> None:
        text = reflow(body)
        if len(text) > 40:
            docs.append({"source": "jargon", "title": title.strip(" :"), "text": text})

    for line in lines[start + 1 :]:
        if re.search(r"[│┌├└─═]", line):  # revision-history table and rules: not prose
            continue
        heading = re.match(r"^(\S.*)$", line) or re.match(r"^   (:[^:]+:.*)$", line)
        if heading:
            flush()
            title, body = heading.group(1), []
        body.append(line[3:] if line.startswith("   ") else line)
    flush()
    return docs


def _dictd_number(code: str) -> int:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    value = 0
    for char in code:
        value = value * 64 + alphabet.index(char)
    return value


def devil_documents(package_root: Path) -> list[dict[str, str]]:
    dictd = package_root / "usr/share/dictd"
    data = gzip.decompress((dictd / "devil.dict.dz").read_bytes())
    entries: dict[int, int] = {}
    for row in (dictd / "devil.index").read_text(encoding="utf-8").splitlines():
        headword, offset_code, length_code = row.split("\t")
        if not headword.startswith("00database"):
            entries[_dictd_number(offset_code)] = _dictd_number(length_code)
    docs = []
    for offset in sorted(entries):
        text = data[offset : offset + entries[offset]].decode("latin-1").replace("_", "")
        title = text.split(",", 1)[0].strip()
        docs.append({"source": "devil", "title": title, "text": reflow(text.splitlines())})
    return docs


# ----------------------------------------------------------------------------------------- smoke
def _dictd_code(value: int) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    code = ""
    while True:
        value, digit = divmod(value, 64)
        code = alphabet[digit] + code
        if not value:
            return code


def smoke_packages(work_dir: Path) -> dict[str, Path]:
    """``--smoke``: the three packages' files as small stand-ins in their layouts (no download): an R lazy-load
    database holding one novel as an XDR character vector, a gzipped Jargon File, a dictd Devil's Dictionary."""
    prose = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife."
    roots = {package: work_dir / package for package in PACKAGES}
    lines = ["PRIDE AND PREJUDICE", "", "Chapter 1", "", *[prose] * 4, "", "Chapter 2", "", *[prose] * 3]
    body = b"".join(struct.pack(">ii", 9, len(line.encode())) + line.encode() for line in lines)
    raw = b"X\n" + struct.pack(">iiiii", 2, 0x40000, 0x20300, 16, len(lines)) + body
    rdb = roots["r-cran-janeaustenr"] / "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
    rdb.parent.mkdir(parents=True)
    rdb.write_bytes(struct.pack(">i", len(raw)) + zlib.compress(raw))
    jargon = roots["jargon-text"] / "usr/share/doc/jargon-text/jargon.txt.gz"
    jargon.parent.mkdir(parents=True)
    text = f"The Jargon File\n\nChapter 1. Introduction\n\n   {prose}\n\n   :hack: n.\n\n   {prose} {prose}\n"
    jargon.write_bytes(gzip.compress(text.encode()))
    dictd = roots["dict-devil"] / "usr/share/dictd"
    dictd.mkdir(parents=True)
    entries = [f"ABSENT, adj. {prose}\n", f"BORE, n. {prose}\n"]
    data, index = "", []
    for entry in entries:
        index.append(f"{entry.split(',')[0].lower()}\t{_dictd_code(len(data))}\t{_dictd_code(len(entry))}")
        data += entry
    (dictd / "devil.dict.dz").write_bytes(gzip.compress(data.encode("latin-1")))
    (dictd / "devil.index").write_text("00databaseinfo\tA\tB\n" + "\n".join(index) + "\n", encoding="utf-8")
    return roots


# ------------------------------------------------------------------------------------------ main
def extract_packages(debs_dir: Path, work_dir: Path) -> dict[str, Path]:
    roots = {}
    for package in PACKAGES:
        debs = sorted(glob.glob(str(debs_dir / f"{package}_*.deb")))
        if not debs:
            logger.info("downloading %s with apt-get download", package)
            subprocess.run(["apt-get", "download", package], cwd=debs_dir, check=True)
            debs = sorted(glob.glob(str(debs_dir / f"{package}_*.deb")))
        roots[package] = work_dir / package
        roots[package].mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg-deb", "-x", debs[-1], str(roots[package])], check=True)
        logger.info("extracted %s", os.path.basename(debs[-1]))
    return roots


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debs-dir", type=Path, default=None, help="where the .deb files are / go")
    parser.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_OUT} (the shipped corpus)")
    parser.add_argument("--json", type=Path, help="also write the counts here")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: small stand-ins of the three packages' "
                        "files instead of the packages (no download; tests; needs --out)")
    args = parser.parse_args()
    if args.smoke and args.out is None:
        parser.error("--smoke needs --out (it must not overwrite the shipped corpus)")
    args.out = args.out or DEFAULT_OUT
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            roots = smoke_packages(Path(tmp) / "x")
        else:
            debs_dir = args.debs_dir or Path(tmp) / "debs"
            debs_dir.mkdir(parents=True, exist_ok=True)
            roots = extract_packages(debs_dir, Path(tmp) / "x")
        docs = (
            austen_documents(roots["r-cran-janeaustenr"])
            + jargon_documents(roots["jargon-text"])
            + devil_documents(roots["dict-devil"])
        )
    payload = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs).encode("utf-8")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME))
    chars = sum(len(doc["text"]) for doc in docs)
    for source in ("austen", "jargon", "devil"):
        part = [doc for doc in docs if doc["source"] == source]
        logger.info("%-7s %5d documents, %9d characters", source, len(part), sum(len(d["text"]) for d in part))
    logger.info("wrote %s: %d documents, %d characters, %d bytes compressed", args.out, len(docs), chars,
                args.out.stat().st_size)
    if args.json:
        args.json.write_text(json.dumps({"out": str(args.out), "documents": len(docs), "characters": chars,
                                         "bytes": args.out.stat().st_size,
                                         "by_source": {source: sum(doc["source"] == source for doc in docs)
                                                       for source in ("austen", "jargon", "devil")}}, indent=1))


if __name__ == "__main__":
    main()
