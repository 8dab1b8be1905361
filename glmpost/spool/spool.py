"""The spool: a directory protocol over ordinary shards that lets stages run concurrently
(formats/SPEC.md §12; brief, the asynchronous loop: ``queue.pop_ready``, drop if ``current_version -
v_rollout > tau``).

::

    SPOOL/spool.json                    format, version, tokenizer_revision (created once)
    SPOOL/consumer_root                 the checkpoint root the trainers of this spool publish into
    SPOOL/ready/NAME.msgpack.zst        published shards, oldest first (modification time, then name)
    SPOOL/claimed/CONSUMER/NAME...      a consumer's claimed shards, and its lease.json
    SPOOL/done/NAME.msgpack.zst         consumed shards (the update that trained them is published)
    SPOOL/ledger.jsonl                  one line per consumed shard: consumer, version, trajectory ids
    SPOOL/producers/NAME/               a producer's home (stage.json, metrics.jsonl), made when it opens
    SPOOL/producers/NAME/closed.json    its end of stream: it will publish nothing more

Every step is one atomic rename on one file system: a producer writes a shard under a hidden
temporary name in ``ready/`` and renames it to its final name (the shard writer's rule, SPEC §8),
so a consumer never sees half a shard; a consumer claims a shard by renaming it into its own
claim area (two consumers racing for one shard: exactly one rename succeeds); a consumer whose
lease expired (it stopped renewing: killed, hung) has its claims renamed back to ``ready/`` by any
other consumer. Every shard stays a valid input to any stage wherever it sits.

End of stream: a producer opens its stream when it starts (:meth:`Spool.open_producer`) and
closes it when it finishes (:meth:`Spool.close_producer`: ``--max-rounds`` done, its input ended,
SIGTERM), after its last shard is published. The spool is *closed* when every producer that opened
it has closed, and *ended* for a consumer when it is closed and no shard is left for it (none ready,
none claimed by another consumer): a follower then stops, finishing what it holds.

Exactly-once is defined by trajectory id: a consumer commits a claim by publishing a checkpoint
version whose manifest lists the shards and ids it trained (the commit record), then appending the
ledger and moving the shards to ``done/``; after a crash between the two, :meth:`Spool.reconcile`
finishes the move from the manifests. A trainer skips records whose id the ledger already holds,
so a trajectory published twice (a producer that restarted) is trained at most once.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from glmpost.errors import GlmpostError
from glmpost.formats.shards import SHARD_SUFFIX
from glmpost.fsutil import fsync_dir, write_text_atomic

SPOOL_FORMAT = "glmpost-spool"
SPOOL_VERSION = 1
DEFAULT_LEASE_S = 60.0
CLOSED = "closed.json"


class SpoolError(GlmpostError):
    """A spool refused: another tokenizer, another consumer root, a malformed spool directory."""


@dataclass(frozen=True)
class Depth:
    """Shards per area."""

    ready: int
    claimed: int
    done: int


def _create_exclusive(path: Path, text: str) -> bool:
    """Create ``path`` with ``text`` unless it exists (atomically: a hard link of a complete
    temporary file); True when this call created it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        fsync_dir(path.parent)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


class Spool:
    """One spool directory (see the module doc). ``Spool(path, tokenizer_revision=R)`` creates it or
    opens it; a spool made for another tokenizer revision is refused (a :class:`SpoolError`)."""

    def __init__(self, path: Path | str, *, tokenizer_revision: str, create: bool = True):
        self.path = Path(path)
        self.ready_dir, self.claimed_dir, self.done_dir = self.path / "ready", self.path / "claimed", self.path / "done"
        self.ledger_path = self.path / "ledger.jsonl"
        meta_path = self.path / "spool.json"
        if not meta_path.is_file():
            if not create:
                raise SpoolError(f"{self.path}: not a spool (no spool.json)")
            for area in (self.ready_dir, self.claimed_dir, self.done_dir):
                area.mkdir(parents=True, exist_ok=True)
            _create_exclusive(meta_path, json.dumps({"format": SPOOL_FORMAT, "version": SPOOL_VERSION,
                                                     "tokenizer_revision": tokenizer_revision}) + "\n")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpoolError(f"{meta_path}: unreadable ({exc})") from None
        if meta.get("format") != SPOOL_FORMAT or meta.get("version") != SPOOL_VERSION:
            raise SpoolError(f"{meta_path}: not a version-{SPOOL_VERSION} glmpost spool ({meta.get('format')!r} "
                             f"version {meta.get('version')!r})")
        if meta.get("tokenizer_revision") != tokenizer_revision:
            raise SpoolError(f"{self.path}: spool of tokenizer revision {meta.get('tokenizer_revision')}, this stage's "
                             f"checkpoint has {tokenizer_revision}; one spool carries one tokenizer's ids")
        self.tokenizer_revision = tokenizer_revision
        self._ledger_read: tuple[int, list[dict[str, Any]]] = (0, [])  # bytes parsed so far, their entries

    # -- producers ---------------------------------------------------------------------------

    def publish_path(self, name: str) -> Path:
        """Where a producer writes shard ``name`` (a :class:`~glmpost.formats.ShardWriter` path: it
        builds the file under a hidden name in ``ready/`` and renames it, so it appears whole)."""
        if not name.endswith(SHARD_SUFFIX) or "/" in name or name.startswith("."):
            raise ValueError(f"spool shard name {name!r}: expected NAME{SHARD_SUFFIX}, no '/', not hidden")
        return self.ready_dir / name

    def names(self) -> set[str]:
        """Every shard name the spool holds, in any area (what producers have published)."""
        found = {p.name for p in _shards(self.ready_dir)} | {p.name for p in _shards(self.done_dir)}
        for claims in _consumers(self.claimed_dir):
            found |= {p.name for p in _shards(claims)}
        return found

    # -- end of stream (module doc) -----------------------------------------------------------

    def producer_home(self, name: str) -> Path:
        return self.path / "producers" / name

    def open_producer(self, name: str) -> Path:
        """Register producer ``name`` (again, after a restart: its stream is open once more); returns its home."""
        home = self.producer_home(name)
        home.mkdir(parents=True, exist_ok=True)
        (home / CLOSED).unlink(missing_ok=True)
        return home

    def close_producer(self, name: str, reason: str) -> None:
        """Producer ``name`` publishes nothing more (called after its last shard is published)."""
        write_text_atomic(self.producer_home(name) / CLOSED, json.dumps(
            {"producer": name, "reason": reason, "closed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")

    def reopen(self) -> list[str]:
        """Open every producer's stream again (what an orchestrator does before it restarts them, so
        that no follower it starts beside them finds the spool still closed); returns their names."""
        homes = self._producer_homes()
        for home in homes:
            (home / CLOSED).unlink(missing_ok=True)
        return [home.name for home in homes]

    def _producer_homes(self) -> list[Path]:
        return sorted(d for d in (self.path / "producers").glob("*") if d.is_dir())

    def closed(self) -> bool:
        """Every producer that opened the spool has closed it (and one at least opened it)."""
        homes = self._producer_homes()
        return bool(homes) and all((home / CLOSED).is_file() for home in homes)

    def ended(self, consumer: str) -> bool:
        """Closed, and nothing left for ``consumer``: no shard ready, none claimed by another consumer.
        (Closed is looked at first: a shard published before the close is then seen as ready.)"""
        if not self.closed():
            return False
        others = [c for c in _consumers(self.claimed_dir) if c.name != consumer]
        return not _shards(self.ready_dir) and not any(_shards(c) for c in others)

    # -- consumers ---------------------------------------------------------------------------

    def bind_consumer_root(self, root: Path | str) -> None:
        """Record the checkpoint root this spool's trainers publish into; another root is refused
        (two trainers of different runs would each train what the other skipped)."""
        root = str(Path(root).resolve())
        target = self.path / "consumer_root"
        _create_exclusive(target, root + "\n")
        bound = target.read_text().strip()
        if bound != root:
            raise SpoolError(f"{self.path}: consumed by the trainers of {bound}; a trainer publishing into {root} "
                             "needs its own spool")

    def _claims(self, consumer: str) -> Path:
        if not consumer or "/" in consumer or consumer.startswith("."):
            raise ValueError(f"consumer name {consumer!r}: non-empty, no '/', not hidden")
        return self.claimed_dir / consumer

    def renew(self, consumer: str, lease_s: float = DEFAULT_LEASE_S) -> None:
        """Hold ``consumer``'s claims for another ``lease_s`` seconds (call well within the lease)."""
        claims = self._claims(consumer)
        claims.mkdir(parents=True, exist_ok=True)
        now = time.time()
        write_text_atomic(claims / "lease.json", json.dumps({"consumer": consumer, "pid": os.getpid(), "host": socket.gethostname(),
                                                            "renewed": now, "expires": now + lease_s}) + "\n")

    def claimed(self, consumer: str) -> list[Path]:
        """``consumer``'s claimed shards, oldest publication first."""
        return _oldest_first(_shards(self._claims(consumer)))

    def claim(self, consumer: str, *, limit: int | None = None, lease_s: float = DEFAULT_LEASE_S) -> list[Path]:
        """Renew ``consumer``'s lease, return expired claims to ``ready/``, then claim up to ``limit``
        ready shards (oldest first); returns the newly claimed paths (a shard another consumer took
        first is skipped)."""
        self.renew(consumer, lease_s)
        self.reap()
        claims, taken = self._claims(consumer), []
        for shard in _oldest_first(_shards(self.ready_dir)):
            if limit is not None and len(taken) >= limit:
                break
            try:
                os.rename(shard, claims / shard.name)
            except FileNotFoundError:
                continue  # another consumer claimed it first
            taken.append(claims / shard.name)
        if taken:
            fsync_dir(claims)
            fsync_dir(self.ready_dir)
        return taken

    def release(self, consumer: str, shards: Iterable[Path] | None = None) -> int:
        """Return ``shards`` (default: all of ``consumer``'s claims) to ``ready/``; their count."""
        count = 0
        for shard in list(shards) if shards is not None else self.claimed(consumer):
            try:
                os.rename(shard, self.ready_dir / shard.name)
                count += 1
            except FileNotFoundError:
                pass
        if count:
            fsync_dir(self.ready_dir)
        return count

    def reap(self, now: float | None = None) -> int:
        """Return the claims of every consumer whose lease expired (or was never written) to
        ``ready/``; their count."""
        now = time.time() if now is None else now
        returned = 0
        for claims in _consumers(self.claimed_dir):
            try:
                lease = json.loads((claims / "lease.json").read_text())
                expires = float(lease["expires"])
            except (OSError, ValueError, KeyError, TypeError):
                expires = 0.0
            if expires < now:
                returned += self.release(claims.name, _shards(claims))
        return returned

    def commit(self, consumer: str, shards: Iterable[Path], *, version: int, ids: dict[str, list[str]]) -> None:
        """``shards`` were trained into published ``version``: append a ledger line per shard (with
        ``ids[shard name]``, its trajectory ids), then move it to ``done/``. Idempotent per shard."""
        logged = {entry["shard"] for entry in self.ledger()}
        lines = []
        for shard in shards:
            if shard.name not in logged:
                lines.append(json.dumps({"shard": shard.name, "consumer": consumer, "version": version,
                                         "ids": list(ids.get(shard.name, [])), "time": time.time()}) + "\n")
        if lines:
            with open(self.ledger_path, "a") as ledger:
                if self._torn():
                    lines.insert(0, "\n")  # end a torn line (a crash mid-append) so this one stays whole
                ledger.write("".join(lines))
                ledger.flush()
                os.fsync(ledger.fileno())
        for shard in shards:
            source = self._claims(consumer) / shard.name
            if source.exists():
                os.rename(source, self.done_dir / shard.name)
        fsync_dir(self.done_dir)

    def reconcile(self, consumer: str, committed: dict[str, tuple[int, list[str]]]) -> int:
        """Finish commits a crash interrupted: each of ``consumer``'s claimed shards named in
        ``committed`` (shard name -> (version, ids), from the published versions' manifests) is
        ledgered and moved to ``done/``. Returns how many."""
        finished = [shard for shard in self.claimed(consumer) if shard.name in committed]
        for shard in finished:
            version, ids = committed[shard.name]
            self.commit(consumer, [shard], version=version, ids={shard.name: ids})
        return len(finished)

    # -- reading ---------------------------------------------------------------------------

    def _torn(self) -> bool:
        """The ledger's last line lacks its newline (a crash mid-append)."""
        try:
            with open(self.ledger_path, "rb") as ledger:
                size = ledger.seek(0, os.SEEK_END)
                return size > 0 and ledger.seek(size - 1) >= 0 and ledger.read(1) != b"\n"
        except FileNotFoundError:
            return False

    def ledger(self) -> list[dict[str, Any]]:
        """The ledger's entries, in order (a torn line, from a crash mid-append, is ignored). The
        ledger only grows: each call parses the complete lines appended since the last one."""
        offset, entries = self._ledger_read
        try:
            with open(self.ledger_path, "rb") as ledger:
                if os.fstat(ledger.fileno()).st_size < offset:  # replaced by another file: read it all
                    offset, entries = 0, []
                ledger.seek(offset)
                data = ledger.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]  # a line still being appended waits for its newline
        entries = list(entries)
        for line in whole.splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        self._ledger_read = (offset + len(whole), entries)
        return list(entries)

    def consumed_ids(self) -> set[str]:
        """Trajectory ids the ledger records as trained."""
        return {i for entry in self.ledger() for i in entry.get("ids", [])}

    def depth(self) -> Depth:
        claimed = sum(len(_shards(c)) for c in _consumers(self.claimed_dir))
        return Depth(len(_shards(self.ready_dir)), claimed, len(_shards(self.done_dir)))


def spool_revision(path: Path | str) -> str:
    """The tokenizer revision an existing spool was made for (its ``spool.json``)."""
    meta_path = Path(path) / "spool.json"
    try:
        return str(json.loads(meta_path.read_text())["tokenizer_revision"])
    except (OSError, ValueError, KeyError) as exc:
        raise SpoolError(f"{path}: not a spool ({meta_path}: {exc})") from None


@contextlib.contextmanager
def lease_kept(spool: Spool, consumer: str, lease_s: float = DEFAULT_LEASE_S) -> Iterator[None]:
    """Hold ``consumer``'s lease while the block runs: renewed now and every third of ``lease_s``
    from a daemon thread (a killed process stops renewing, so its claims expire)."""
    stopped = threading.Event()

    def renew() -> None:
        while not stopped.wait(lease_s / 3):
            spool.renew(consumer, lease_s)

    spool.renew(consumer, lease_s)
    thread = threading.Thread(target=renew, daemon=True, name=f"lease {consumer}")
    thread.start()
    try:
        yield
    finally:
        stopped.set()


def _shards(directory: Path) -> list[Path]:
    try:
        return [p for p in directory.iterdir() if p.name.endswith(SHARD_SUFFIX) and not p.name.startswith(".")]
    except FileNotFoundError:
        return []


def _consumers(directory: Path) -> list[Path]:
    try:
        return [p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except FileNotFoundError:
        return []


def _oldest_first(paths: list[Path]) -> list[Path]:
    def key(path: Path):
        try:
            return (path.stat().st_mtime_ns, path.name)
        except FileNotFoundError:
            return (0, path.name)

    return sorted(paths, key=key)
