"""Glob patterns expanded as :func:`glob.glob` does (``*``, ``?``, ``[...]``; ``**`` as a whole
component: any number of directories; names starting with ``.`` only where the pattern spells the
dot), but each real directory visited once: a symbolic link back into a directory already walked (a
loop, or a second name of one directory) is not followed again, so a recursive pattern over a tree
with loops ends. :func:`expand_pattern` returns the matches and the loops it skipped, which the
caller reports in one line.
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import os
from functools import lru_cache

MAGIC = "*?["


def has_magic(text: str) -> bool:
    """Whether ``text`` holds a glob wildcard."""
    return any(c in text for c in MAGIC)


def is_loop(path: str) -> bool:
    """Whether resolving ``path`` runs into a symbolic link loop (``ELOOP``)."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def expand_pattern(pattern: str) -> tuple[list[str], list[str]]:
    """``(matches sorted, loops skipped as "link -> target")`` of the glob ``pattern`` (module doc)."""
    parts = pattern.split("/")
    if "**" not in parts:
        return sorted(glob.glob(pattern)), []
    first = parts.index("**")
    dirs_only = len(parts) > 1 and parts[-1] == ""  # a trailing slash: directories only, as glob does
    prefix, rest = "/".join(parts[:first]), tuple(parts[first:len(parts) - dirs_only])
    if first == 1 and parts[0] == "":
        prefix = "/"
    bases = sorted(glob.glob(prefix)) if has_magic(prefix) else [prefix or "."]
    hidden = any(p.startswith(".") for p in rest)
    matches: list[str] = []
    loops: list[str] = []
    seen: set[tuple[int, int]] = set()
    for base in bases:
        if not os.path.isdir(base):
            continue
        for rel in _walk(base, seen, loops, hidden=hidden):
            if (rel or prefix) and _match_from(rest, rel):
                matches.append(_join(base, prefix, rel))
    if dirs_only:
        matches = [m for m in matches if os.path.isdir(m)]
    return sorted(set(matches)), loops


def _join(base: str, prefix: str, rel: tuple[str, ...]) -> str:
    if not rel:
        return base
    tail = "/".join(rel)
    return tail if not prefix else (base.rstrip("/") + "/" + tail if base != "/" else "/" + tail)


def _walk(base: str, seen: set[tuple[int, int]], loops: list[str], *, hidden: bool):
    """Relative parts of ``base`` and of everything under it, each real directory entered once:
    the directories themselves first, then those reached through links; a link to a directory
    already entered is not entered again, and goes into ``loops`` when it points at a directory
    that holds it (or at itself)."""
    key = _identity(base)
    if key is None or key in seen:
        return
    seen.add(key)
    yield ()
    real: list[tuple[str, tuple[str, ...]]] = [(base, ())]
    links: list[tuple[str, tuple[str, ...]]] = []
    while real or links:
        directory, rel = real.pop() if real else _enter_link(links, seen, loops)
        if not directory:
            continue
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name, reverse=True)
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(".") and not hidden:
                continue
            child = (*rel, entry.name)
            yield child
            if entry.is_symlink():
                if is_loop(entry.path):
                    loops.append(f"{entry.path} -> itself")
                elif os.path.isdir(entry.path):
                    links.append((entry.path, child))
            elif entry.is_dir() and _identity(entry.path) not in seen:
                seen.add(_identity(entry.path))
                real.append((entry.path, child))


def _enter_link(links: list[tuple[str, tuple[str, ...]]], seen: set, loops: list[str]) -> tuple[str, tuple[str, ...]]:
    """The first link of ``links`` (taken off) when its directory was not entered yet (now marked),
    else ``("", ())``; a link into a directory that holds it is a loop, added to ``loops``."""
    path, rel = links.pop(0)
    key = _identity(path)
    if key is not None and key not in seen:
        seen.add(key)
        return path, rel
    target, holder = os.path.realpath(path), os.path.realpath(os.path.dirname(path))
    if holder == target or holder.startswith(target.rstrip("/") + "/"):
        loops.append(f"{path} -> {target}")
    return "", ()


def _identity(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


@lru_cache(maxsize=4096)
def _match_from(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether ``parts`` match ``pattern`` component by component, ``**`` standing for any number."""
    if not pattern:
        return not parts
    head, tail = pattern[0], pattern[1:]
    if head == "**":
        if _match_from(tail, parts):
            return True
        return bool(parts) and _match_from(pattern, parts[1:])
    if not parts:
        return False
    if parts[0].startswith(".") and not head.startswith("."):
        return False
    return fnmatch.fnmatchcase(parts[0], head) and _match_from(tail, parts[1:])
