"""Shared pieces of the prompt generators: where a generator reads its inputs (the manifest's
prompt files, through a Context), the held-out filter every set since distill4 applies, and the
text this machine's packages provide (fortunes, the Jargon File, Python 3.11's standard library,
the Rust toolchain's HTML docs).

A source that is missing raises SourceMissing instead of being skipped: the old scripts skipped
it silently and wrote a different file, which the committed answers would then not match."""
import functools
import glob
import gzip
import html
import json
import os
import pathlib
import re
import sys


class SourceMissing(RuntimeError):
    """A file a generator reads is not on this machine (the message says what to install)."""


class Context:
    """Where the generators read the prompt files of other sets and of the eval/tune prompts.

    `base` is the directory the manifest's paths are relative to: training/ itself, or a scratch
    copy of it (make-prompts --check), so a set that reads earlier sets reads the copies
    regenerated there."""

    def __init__(self, manifest, base):
        self.manifest = manifest
        self.base = pathlib.Path(base)
        self.sets = {s["id"]: s for s in manifest.get("set", [])}
        self.evals = {e["id"]: e for e in manifest.get("eval", [])}

    def prompts_path(self, set_id):
        entry = self.sets.get(set_id) or self.evals.get(set_id)
        if entry is None:
            raise KeyError(f"{set_id}: no such set or eval entry in corpus.toml")
        return self.base / entry["prompts"]

    def read(self, set_id):
        p = self.prompts_path(set_id)
        if not p.exists():
            raise SourceMissing(f"{p}: the prompts of {set_id} are needed first (training/make-prompts {set_id})")
        return p.read_text(encoding="utf-8")

    def held_out(self):
        """The eval and tune prompt files, lower-cased, joined by newlines: a generated prompt
        that occurs in this text is dropped (they are never trained on)."""
        return "\n".join(self.read(e).lower() for e in self.evals)

    def seen(self, set_ids):
        """The prompts (first turns) of earlier sets, so a new set does not ask them again.
        A plain-text set contributes every line, stripped (its comment line too, as the old
        scripts did); a JSONL set each record's "prompt", or its first turn."""
        out = set()
        for s in set_ids:
            text = self.read(s)
            if self.prompts_path(s).suffix == ".jsonl":
                out.update(r.get("prompt") or r["turns"][0] for r in map(json.loads, filter(str.strip, text.splitlines())))
            else:
                out.update(l.strip() for l in text.splitlines())
        return out


def read_prompt_records(text, is_jsonl):
    """(line number, turns) for each prompt in a prompt file, skipping blank and comment lines."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            v = json.loads(line)
            turns = [v["prompt"]] if "prompt" in v else v["turns"]
        else:
            turns = [line]
        out.append((n, turns))
    return out


# Topics of the bundled eval and tune prompts: a prompt containing one of these (lower-cased) is
# dropped, so those prompts stay unseen. distill4 and distill5 used BANNED; distill6, distill8 and
# distill9 BANNED_WIDER ("bicycle" for "bicycle stays", and "exercising").
BANNED = ["refrigerator", "dna", "sky blue", "airplane", "sorts a list of dictionaries", "number of lines", "for loop",
          "customers", "plastic", "camping", "planets", "food groups", "documents now", "raining heavily", "consensus",
          "pet goldfish", "healthy breakfast", "stay motivated", "guitar", "street party", "autumn leaves",
          "water bottle", "bicycle stays", "lighthouse", "reading every day", "sum of the even", "virus", "clear emails",
          "butterfly", "cpu", "vegetable soup", "inflation", "thank-you note to a teacher", "flat tire", "compass",
          "working from home", "capitalizes the first letter", "no time"]
BANNED_WIDER = [("bicycle" if b == "bicycle stays" else b) for b in BANNED] + ["exercising"]


def keep(prompts, banned, held, seen=()):
    """The prompts in first-occurrence order without duplicates, dropping those that contain a
    banned topic, occur in the held-out text, or were asked by an earlier set."""
    return [p for p in dict.fromkeys(prompts)
            if not any(b in p.lower() for b in banned) and p.lower() not in held and p not in seen]


def text_file(header, prompts):
    """A plain-text prompt file: one comment line, then one prompt per line."""
    return header + "\n" + "\n".join(prompts) + "\n"


def jsonl_file(records, ensure_ascii=True):
    return "".join(json.dumps(r, ensure_ascii=ensure_ascii) + "\n" for r in records)


# ---- Text on this machine -----------------------------------------------------------------

FORTUNES = pathlib.Path("/usr/share/games/fortunes")
JARGON = pathlib.Path("/usr/share/doc/jargon-text/jargon.txt.gz")
PYTHON_LIB = pathlib.Path("/usr/lib/python3.11")


def fortune_quotes(names, max_len, plain=False):
    """Fortunes of the named files (Debian packages fortunes and fortunes-min), whitespace
    collapsed, 30..max_len characters, ASCII; with plain, none with a double quote or " -- "."""
    quotes = []
    for name in names:
        p = FORTUNES / name
        if not p.exists():
            raise SourceMissing(f"{p}: apt-get install fortunes fortunes-min")
        for q in p.read_text(errors="replace").split("\n%\n"):
            q = " ".join(q.split())
            if 30 <= len(q) <= max_len and q.isascii() and (not plain or ('"' not in q and " -- " not in q)):
                quotes.append(q)
    return quotes


def jargon_headwords():
    """The Jargon File's headwords (Debian package jargon-text)."""
    if not JARGON.exists():
        raise SourceMissing(f"{JARGON}: apt-get install jargon-text")
    text = gzip.open(JARGON, "rt", errors="replace").read()
    words = sorted(set(w.strip() for w in re.findall(r"^   :([^:\n]{2,30}):", text, re.M)))
    return [w for w in words if re.fullmatch(r"[A-Za-z][A-Za-z0-9 '\-]+", w)]


def python_lib():
    """Debian's Python 3.11 standard-library directory (package libpython3.11-stdlib)."""
    if not PYTHON_LIB.is_dir():
        raise SourceMissing(f"{PYTHON_LIB}: apt-get install libpython3.11-stdlib")
    return PYTHON_LIB


def require_python_311(set_id):
    """distill8 and distill9 read the running interpreter's modules and docstrings."""
    if sys.version_info[:2] != (3, 11):
        raise SourceMissing(f"{set_id} reads the running Python's standard library; the committed file was made with "
                            f"Python 3.11 (this is {sys.version.split()[0]}): run training/make-prompts with python3.11")


RUST_DOCS_VERSION = "1.95.0"


def rust_docs_version(path):
    """The release a docs directory is for, from its version_info.html ("Rust</a> 1.95.0")."""
    try:
        m = re.search(r"Rust</a> ([^<\s]+)", (pathlib.Path(path) / "version_info.html").read_text(errors="replace"))
    except OSError:
        return None
    return m.group(1) if m else None


@functools.lru_cache(maxsize=None)
def rust_docs():
    """The Rust toolchain's HTML docs the committed distill6, distill8 and distill9 files were made
    from: Rust 1.95.0's (another release lists other items and paragraphs, and every prompt after
    the first difference changes). $SELFSPEC_RUST_DOCS if set (used whatever its release, with a
    warning); else the last by name of ~/.rustup/toolchains/*/share/doc/rust/html that holds
    1.95.0's docs (the old scripts took the last by name, whatever its release: here stable's,
    1.95.0)."""
    env = os.environ.get("SELFSPEC_RUST_DOCS")
    if env:
        if not pathlib.Path(env, "std").is_dir():
            raise SourceMissing(f"SELFSPEC_RUST_DOCS={env}: not a Rust HTML docs directory (no std/)")
        v = rust_docs_version(env)
        if v != RUST_DOCS_VERSION:
            print(f"warning: {env} holds Rust {v}'s docs; the committed prompts came from {RUST_DOCS_VERSION}'s", file=sys.stderr)
        return pathlib.Path(env)
    docs = sorted(glob.glob(str(pathlib.Path.home() / ".rustup/toolchains/*/share/doc/rust/html")))
    found = [d for d in docs if rust_docs_version(d) == RUST_DOCS_VERSION]
    if not found:
        seen = ", ".join(f"{d} ({rust_docs_version(d)})" for d in docs) or "none"
        raise SourceMissing(f"Rust {RUST_DOCS_VERSION}'s HTML docs (found: {seen}): "
                            f"rustup toolchain install {RUST_DOCS_VERSION} --component rust-docs, or set SELFSPEC_RUST_DOCS")
    return pathlib.Path(found[-1])


def rust_std_items():
    """(kind, path) of the standard library's structs, traits, functions, macros and enums, from
    the docs' file names (struct.Vec.html -> ("struct", "std::vec::Vec")), leaving out arch,
    intrinsics and simd."""
    std = rust_docs() / "std"
    items = set()
    for p in std.rglob("*.html"):
        m = re.fullmatch(r"(struct|trait|fn|macro|enum)\.(\w+)\.html", p.name)
        if m and "arch" not in p.parts and "intrinsics" not in p.parts and "simd" not in p.parts:
            module = "::".join(p.relative_to(std).parts[:-1])
            items.add((m.group(1), f"std::{module}::{m.group(2)}" if module else f"std::{m.group(2)}"))
    return items


def html_paragraphs(files, min_len, max_len):
    """The text of every <p> in the files, tags removed, entities decoded, whitespace collapsed,
    min_len..max_len characters, ASCII; in file order."""
    paras = []
    for p in files:
        for m in re.finditer(r"<p>(.*?)</p>", p.read_text(errors="replace"), re.S):
            t = " ".join(html.unescape(re.sub(r"<[^>]+>", "", m.group(1))).split())
            if min_len <= len(t) <= max_len and t.isascii():
                paras.append(t)
    return paras
