"""The training corpus: the Python sources installed on this machine.

Sources are the interpreter's standard library and its site-packages (``sysconfig`` purelib
and platlib).  Every ``.py`` file is read once, filtered (UTF-8, no NUL, not empty, not too
large, no very long lines: those are generated tables and embedded data, not code),
deduplicated by the sha256 of its bytes (the first path in sorted order keeps the content) and
split into train / held-out by whole directory, so held-out files never share a package
directory with training files.  Everything is deterministic: the same machine image gives the
same manifest, which a resumed run checks by digest.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

# Directories never walked: caches, and other installations' trees met inside the stdlib
# (a venv's or distribution's site-packages is a root of its own when the interpreter uses it).
PRUNE_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git"}
TEST_DIRS = {"test", "tests", "testing"}


@dataclass
class SourceFile:
    path: str           # absolute path on this machine
    root: str           # "stdlib" or "site"
    rel: str            # path inside its root, "/"-separated
    size: int           # bytes on disk
    sha256: str         # of the bytes on disk
    text: str = field(repr=False, default="")   # decoded, "\r\n" -> "\n"
    split: str = "train"
    group: str = ""     # the held-out unit: root + directory

    def manifest_row(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256,
                "split": self.split, "group": self.group}


@dataclass
class Limits:
    max_file_bytes: int = 400_000
    max_line_chars: int = 1000


def sha256_hex(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def source_roots() -> list[tuple[str, str]]:
    """(kind, absolute dir) of the stdlib and each distinct site-packages directory."""
    paths = sysconfig.get_paths()
    roots, seen = [], set()
    for kind, key in (("stdlib", "stdlib"), ("site", "purelib"), ("site", "platlib")):
        d = os.path.realpath(paths.get(key) or "")
        if d and os.path.isdir(d) and d not in seen:
            seen.add(d)
            roots.append((kind, d))
    return roots


def list_sources(roots, skip_tests: bool = False) -> list[tuple[str, str, str]]:
    """Sorted (kind, root, rel) of every .py file under the roots."""
    out = []
    for kind, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in PRUNE_DIRS
                                 and not d.startswith(".")
                                 and not (skip_tests and d in TEST_DIRS))
            for name in filenames:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, name), root)
                    out.append((kind, root, rel.replace(os.sep, "/")))
    out.sort()
    return out


def read_source(item: tuple[str, str, str], limits: Limits) -> SourceFile | str:
    """The file, or the reason it is left out.  Runs in a thread: the read and the hash
    release the GIL, which is where the time goes."""
    kind, root, rel = item
    path = os.path.join(root, rel)
    if os.path.islink(path):
        return "link"
    try:
        with open(path, "rb") as fh:
            data = fh.read(limits.max_file_bytes + 1)
    except OSError:
        return "unreadable"
    if not data.strip():
        return "empty"
    if len(data) > limits.max_file_bytes:
        return "too large"
    if b"\0" in data:
        return "binary"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not utf-8"
    text = text.replace("\r\n", "\n")
    if max(map(len, text.split("\n"))) > limits.max_line_chars:
        return "long lines"
    return SourceFile(path=path, root=kind, rel=rel, size=len(data), sha256=sha256_hex(data),
                      text=text)


def sample_by_hash(items: list, n: int | None, key) -> list:
    """The n items whose key hashes lowest: a deterministic sample spread over all packages."""
    if n is None or n >= len(items):
        return items
    return sorted(sorted(items, key=lambda it: sha256_hex(key(it)))[:n], key=key)


def read_corpus(items, limits: Limits, workers: int) -> tuple[list[SourceFile], dict]:
    """Read, filter and deduplicate; returns the kept files in path order and the counts."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(lambda it: read_source(it, limits), items))
    dropped: dict[str, int] = {}
    kept, seen = [], set()
    for res in results:
        if isinstance(res, str):
            dropped[res] = dropped.get(res, 0) + 1
        elif res.sha256 in seen:
            dropped["duplicate"] = dropped.get("duplicate", 0) + 1
        else:
            seen.add(res.sha256)
            kept.append(res)
    return kept, dropped


def group_of(f: SourceFile) -> str:
    """The held-out unit: a file's directory (a package or sub-package); a top-level module
    (os.py, six.py) is its own unit."""
    d = os.path.dirname(f.rel)
    return f"{f.root}:{d or f.rel}"


def assign_split(files: list[SourceFile], frac: float, min_files: int,
                 max_group_files: int) -> None:
    """Mark whole groups held-out, in the order of their name's sha256, until at least
    max(min_files, frac * N) files are held out.  Groups of more than max_group_files files
    are passed over, so the held-out set spreads over many packages instead of one big one."""
    groups: dict[str, list[SourceFile]] = {}
    for f in files:
        f.group = group_of(f)
        f.split = "train"
        groups.setdefault(f.group, []).append(f)
    want = max(min_files, math.ceil(frac * len(files)))
    held = 0
    for name in sorted(groups, key=sha256_hex):
        if held >= want:
            break
        members = groups[name]
        if len(members) > max_group_files or held + len(members) > len(files) // 2:
            continue
        for f in members:
            f.split = "heldout"
        held += len(members)


def manifest_lines(files: list[SourceFile]) -> list[str]:
    return [json.dumps(f.manifest_row(), sort_keys=True) for f in files]


def write_manifest(files: list[SourceFile], path: str) -> str:
    """JSON lines (path, size, sha256, split, group) in path order; returns the digest a
    resumed run compares with (the sha256 of the file's bytes)."""
    body = "".join(line + "\n" for line in manifest_lines(files))
    with open(path, "w") as fh:
        fh.write(body)
    return sha256_hex(body)


def manifest_digest(files: list[SourceFile]) -> str:
    return sha256_hex("".join(line + "\n" for line in manifest_lines(files)))


def corpus_stats(files: list[SourceFile], dropped: dict, roots) -> dict:
    out = {"roots": [f"{k}:{d}" for k, d in roots], "dropped": dropped}
    for split in ("train", "heldout"):
        part = [f for f in files if f.split == split]
        out[split] = {"files": len(part), "bytes": sum(len(f.text.encode()) for f in part),
                      "groups": len({f.group for f in part})}
    return out


def build(hp: dict, workers: int, log) -> tuple[list[SourceFile], dict]:
    """The whole corpus step for the hyperparameters ``hp``: list, sample (max_files), read,
    filter, deduplicate, split.  Returns the files (texts included) and their statistics."""
    roots = source_roots()
    items = list_sources(roots, skip_tests=hp["skip_tests"])
    items = sample_by_hash(items, hp["max_files"], key=lambda it: it[1] + "/" + it[2])
    limits = Limits(max_file_bytes=hp["max_file_kb"] * 1000, max_line_chars=hp["max_line_chars"])
    files, dropped = read_corpus(items, limits, workers)
    assign_split(files, hp["heldout_frac"], hp["heldout_min_files"], hp["max_group_files"])
    stats = corpus_stats(files, dropped, roots)
    stats["candidates"] = len(items)
    log(f"corpus: {len(items)} .py files, kept {len(files)} "
        f"({stats['train']['files']} train / {stats['heldout']['files']} held-out in "
        f"{stats['heldout']['groups']} directories), "
        f"{(stats['train']['bytes'] + stats['heldout']['bytes']) / 1e6:.1f} MB; "
        f"dropped {dropped}")
    return files, stats


# ----------------------------------------------------------------------------- prompts

def file_prefix(text: str, min_lines: int = 8, max_lines: int = 20,
                max_chars: int = 1200) -> tuple[str, str] | None:
    """A prefix of a file cut at a line end, and its kind.

    "def": the first 8-20 lines ending with a one-line ``def``/``class`` signature, so the
    continuation is a body (the demo's own prompt is ``def fibonacci(n):``).  "lines": the
    first ``max_lines`` lines.  None when the file is too short to leave a continuation or the
    prefix is over ``max_chars``."""
    lines = text.splitlines(keepends=True)
    if len(lines) < max_lines + 5:
        return None
    for i in range(min_lines - 1, max_lines):
        s = lines[i].strip()
        if s.startswith(("def ", "async def ", "class ")) and s.endswith(":"):
            prefix = "".join(lines[:i + 1])
            return (prefix, "def") if len(prefix) <= max_chars else None
    prefix = "".join(lines[:max_lines])
    return (prefix, "lines") if len(prefix) <= max_chars else None


def heldout_prompts(files: list[SourceFile], n: int, count_tokens, max_tokens: int) -> list[dict]:
    """At most ``n`` prompts, one per held-out file, files in sha256 order; "def" prefixes
    first, then "lines" prefixes fill up.  ``count_tokens(text)`` must stay <= max_tokens
    (room for 128 new tokens inside the trained context)."""
    candidates = {"def": [], "lines": []}
    for f in sorted((f for f in files if f.split == "heldout"), key=lambda f: f.sha256):
        got = file_prefix(f.text)
        if got is None:
            continue
        text, kind = got
        n_tok = count_tokens(text)
        if n_tok <= max_tokens:
            candidates[kind].append({"path": f.path, "sha256": f.sha256, "kind": kind,
                                     "n_lines": text.count("\n"), "n_tokens": n_tok,
                                     "text": text})
    chosen = (candidates["def"] + candidates["lines"])[:n]
    for i, p in enumerate(chosen):
        p["id"] = i
    return chosen


def write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
