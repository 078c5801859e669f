"""A checkpoint directory on disk: files hashed as they are written, a manifest per rank, and the
directory published whole. No torch.distributed.checkpoint here (it is imported only by
:mod:`tiermem.checkpoint.dcp`, which puts DCP's files through these).

# NOTE [Checkpoint directories]
torch.distributed.checkpoint (DCP) checks nothing it reads back, and its ``.metadata`` is a pickle
it loads as it finds it. For the directories tiermem writes, every byte read back is checked
anyway (NOTE [Data checksums]), and nothing is unpickled that could run code:

- Every file a rank writes (its ``__<r>_<n>.distcp``; rank 0 also ``.metadata``) is created
  exclusively, never through a symlink, mode 0600 (:func:`create_exclusive`), and hashed with
  xxh3_64 in the pass that hands its bytes to the file (:class:`HashedFile`), as the single file is.
- Once DCP is done, each rank writes ``tiermem-rank<r>.json`` (:func:`write_manifest`): the world
  size and every file it wrote, with its size and hash; the manifest's last line is the xxh3_64
  of the lines before it.
- A load opens the directory and every file it reads once, and reads only through those
  descriptors (NOTE [A load reads the files it checked] in :mod:`tiermem.checkpoint.opened`).
  It first reads every manifest (each checked by its own hash; ranks 0..world-1 all there with
  one world size; no file claimed twice), hashes ``.metadata`` on every rank, and the loading
  ranks split the data files between them by size and each hashes its share; every rank learns
  every rank's result before anything a file holds is parsed. Only then is ``.metadata``
  unpickled (restricted to DCP's types), every file it points to checked against the manifests,
  and the ``tiermem`` record read as plain data (NOTE [Nothing in a checkpoint runs] in
  :mod:`tiermem.checkpoint.dcp_read`); a second agreement follows. A failure on any rank
  stops every rank, with the first failing rank's error, before anything of the model changes.
- A directory without any manifest (a user's own ``dcp.save(tm.sharded_state_dict(), ...)``)
  is refused: its bytes cannot be checked. The user's own ``dcp.load`` into
  ``tm.sharded_state_dict()`` and ``tm.load_sharded_state_dict()`` read it.
- ``tm.save`` returns on every rank only once rank 0 has published the directory, and raises on
  every rank if it could not.

A save writes into ``<path>.tmp-<pid of rank 0>``, which rank 0 creates (mode 0700, exclusively),
and rank 0 moves it into place (:func:`publish`) only once every rank's files and manifest are
there: atomically with Linux's ``renameat2(RENAME_EXCHANGE)`` where the filesystem has it, else
by two renames (a process that dies between them leaves the previous checkpoint at
``<path>.old-<pid>``, and says so in the log). What was at ``path`` before (a previous checkpoint
directory, a single-file checkpoint, or a symlink, never followed) is then removed; a directory
there that holds anything but a checkpoint's files is refused before anything is written. A save
also removes the temporaries that saves of dead processes left (as for the single file).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import stat
from typing import BinaryIO, Iterator, Optional

import xxhash

from tiermem.checkpoint.opened import OpenDir
from tiermem.errors import StoreError

log = logging.getLogger(__name__)

METADATA = ".metadata"
MANIFEST = "tiermem-rank{rank}.json"
_MANIFEST = re.compile(r"tiermem-rank(0|[1-9][0-9]{0,6})\.json")
_FORMAT = "tiermem-dcp-manifest-v1"
#: the names DCP and tiermem write into a checkpoint directory: what a save may remove
_OURS = re.compile(r"__[0-9]+_[0-9]+\.distcp|(__[0-9]+)?\.metadata(\.tmp)?|tiermem-rank[0-9]+\.json")
_MANIFEST_CAP = 16 << 20  # a manifest: ~100 bytes a file
Files = dict[str, tuple[int, str]]  # file name -> (bytes, xxh3_64 as 16 hex digits)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` may be alive on this machine (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process, or no pid this machine can have: leave it
        return True
    return True


def create_exclusive(path: str) -> BinaryIO:
    """``path``, new, mode 0600 whatever the umask, never through a symlink (whatever is at that
    name already is refused with ``FileExistsError``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "wb")


class HashedFile:
    """A file being written, hashed (xxh3_64) in the pass that hands each byte to it."""

    def __init__(self, f: BinaryIO):
        self.f, self.hash, self.nbytes, self.closed = f, xxhash.xxh3_64(), 0, False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.f.write(view)
        self.nbytes += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.f.close()

    def digest(self) -> str:
        return self.hash.hexdigest()

    def __enter__(self) -> "HashedFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- manifests ---------------------------------------------------------------------------------------
def write_manifest(directory: str, rank: int, world: int, files: Files) -> None:
    body = json.dumps(
        {
            "format": _FORMAT,
            "rank": rank,
            "world": world,
            "files": {name: {"nbytes": n, "xxh3": h} for name, (n, h) in sorted(files.items())},
        },
        indent=1,
        sort_keys=True,
    ).encode()
    with create_exclusive(os.path.join(directory, MANIFEST.format(rank=rank))) as f:
        f.write(body + b"\n" + xxhash.xxh3_64_hexdigest(body).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifests(opened: OpenDir) -> Optional[Files]:
    """Every file the manifests in the opened directory list, checked as NOTE [Checkpoint
    directories] says; None when there is no manifest (a user's own ``dcp.save``)."""
    directory = opened.path

    def bad(why: str) -> StoreError:
        return StoreError(
            f"tiermem: checkpoint {directory!r} has {why}; nothing was loaded. Use another "
            f"checkpoint, or one written by tm.save() and left unedited"
        )

    names = sorted(n for n in opened.names if _MANIFEST.fullmatch(n))
    if not names:
        return None
    files: Files = {}
    worlds = set()
    for name in names:
        if opened.size(name) > _MANIFEST_CAP:  # read whole to be parsed: bounded before it is read
            raise bad(
                f"a manifest {name!r} of {opened.size(name)} bytes, more than a manifest may hold ({_MANIFEST_CAP})"
            )
        try:
            raw = opened.read(name)
            body, checksum, tail = raw.rsplit(b"\n", 2)
            if tail or xxhash.xxh3_64_hexdigest(body).encode() != checksum:
                raise ValueError("it fails its checksum")
            doc = json.loads(body)
            entries = doc["files"]
            ok = (
                doc["format"] == _FORMAT
                and doc["rank"] == int(_MANIFEST.fullmatch(name)[1])  # type: ignore[index]  # listed by it
                and isinstance(doc["world"], int)
                and isinstance(entries, dict)
            )
        except (StoreError, ValueError, KeyError, TypeError) as err:
            raise bad(f"an unreadable manifest {name!r} ({err})") from None
        if not ok:
            raise bad(f"a manifest {name!r} of another format, rank or world")
        worlds.add(doc["world"])
        for file, e in entries.items():
            good = (
                isinstance(file, str)
                and os.path.basename(file) == file
                and file not in ("", ".", "..")
                and isinstance(e, dict)
                and isinstance(e.get("nbytes"), int)
                and e["nbytes"] >= 0
                and isinstance(e.get("xxh3"), str)
                and re.fullmatch("[0-9a-f]{16}", e["xxh3"]) is not None
            )
            if not good or file in files:
                raise bad(f"a manifest {name!r} listing {file!r} {'twice' if good else 'badly'}")
            files[file] = (e["nbytes"], e["xxh3"])
    if len(worlds) != 1 or names != sorted(MANIFEST.format(rank=r) for r in range(worlds.pop())):
        raise bad(f"manifests {names} that are not one per rank of one save (incomplete, or mixed with another save's)")
    return files


def verify(opened: OpenDir, names: list[str], files: Files) -> None:
    """Each of ``names`` has the size and hash its manifest gives, read through the descriptor
    the load keeps (NOTE [A load reads the files it checked]), or a ``tiermem:`` error. The size
    is compared first: a file that claims more bytes than its manifest is never read."""
    for name in names:
        size = opened.size(name)
        got = (size, "") if size != files[name][0] else opened.hash(name)
        if got != files[name]:
            raise StoreError(
                f"tiermem: checkpoint {opened.path!r} is corrupt ({name!r} fails its checksum"
                f"{'' if got[0] == files[name][0] else f': {got[0]} bytes, not {files[name][0]}'}); "
                f"nothing was loaded. Use another checkpoint"
            )


def share(files: Files, world: int, rank: int) -> list[str]:
    """The files rank ``rank`` of ``world`` hashes: the largest first, each to the rank with the
    fewest bytes so far (the same split on every rank)."""
    load = [0] * world
    mine = []
    for name in sorted(files, key=lambda n: (-files[n][0], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += files[name][0]
        if r == rank:
            mine.append(name)
    return mine


# -- the directory as a whole ------------------------------------------------------------------------
def is_checkpoint_dir(path: str) -> bool:
    """``path`` is a directory holding DCP's metadata or a tiermem manifest."""
    try:
        return os.path.isdir(path) and any(n == METADATA or _MANIFEST.fullmatch(n) for n in os.listdir(path))
    except OSError:
        return False


def check_target(path: str) -> None:
    """A save may replace what is at ``path``: nothing, a file, a symlink, or a directory that holds
    only a checkpoint's files."""
    if os.path.isdir(path) and not os.path.islink(path):
        others = sorted(n for n in os.listdir(path) if not _OURS.fullmatch(n))
        if others:
            raise StoreError(
                f"tiermem: cannot save the checkpoint to {path!r}: it is a directory holding "
                f"{others[:3]}, not a checkpoint; choose another path or empty it"
            )


def make_temporary(path: str, pid: int) -> str:
    """``<path>.tmp-<pid>``, a new directory (mode 0700), after removing those of dead processes."""
    remove_stale(path)
    tmp = f"{path}.tmp-{pid}"
    try:
        os.mkdir(tmp, 0o700)
    except FileExistsError:
        raise StoreError(
            f"tiermem: cannot save the checkpoint to {path!r}: its temporary {tmp!r} already exists "
            f"(left by an earlier process with this pid, or planted there); remove it and save "
            f"again"
        ) from None
    return tmp


def stale_temporaries(path: str) -> Iterator[tuple[os.DirEntry[str], int]]:
    """The ``<path>.tmp-<pid>`` entries beside ``path`` (files or directories) that saves of
    processes now gone left behind, with those pids; never this process's."""
    directory, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(base) + r"\.tmp-([1-9][0-9]{0,9})")
    try:
        entries = list(os.scandir(directory))
    except OSError as e:
        log.warning("tiermem: cannot list %r to remove stale checkpoint temporaries (%s)", directory, e)
        return
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m and int(m[1]) != os.getpid() and not pid_alive(int(m[1])):
            yield entry, int(m[1])


def remove_stale(path: str) -> None:
    """Remove the ``<path>.tmp-<pid>`` directories of saves whose process is gone."""
    for entry, pid in stale_temporaries(path):
        if entry.is_dir(follow_symlinks=False):
            log.info("tiermem: removing %r, left by a save of process %s, which is gone", entry.path, pid)
            discard(entry.path)


def discard(directory: str) -> None:
    """Remove a checkpoint directory tiermem wrote: the files of a checkpoint in it, then the
    directory if nothing else is left (else a warning naming it)."""
    try:
        for entry in os.scandir(directory):
            if _OURS.fullmatch(entry.name) and not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)  # a symlink itself, never its target
        os.rmdir(directory)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("tiermem: could not remove %r entirely (%s); remove it by hand", directory, e)


def _exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` atomically (Linux renameat2 RENAME_EXCHANGE); False where
    this system or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (38, 22, 95):  # ENOSYS, EINVAL, EOPNOTSUPP: not here
        return False
    raise OSError(err, os.strerror(err), b)


def publish(tmp: str, path: str) -> None:
    """Move the complete directory ``tmp`` to ``path``, replacing what was there (NOTE
    [Checkpoint directories])."""
    old: Optional[str] = None
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        old = tmp  # the previous checkpoint, now at the temporary's name
    else:
        old = f"{path}.old-{os.getpid()}"
        os.rename(path, old)
        log.info(
            "tiermem: %r moved to %r while the new checkpoint takes its place (no atomic exchange on this filesystem)",
            path,
            old,
        )
        os.rename(tmp, path)
    sync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        mode = os.lstat(old).st_mode
        if stat.S_ISDIR(mode):
            discard(old)
        else:
            os.unlink(old)  # a single-file checkpoint, or a symlink itself


def sync_dir(directory: str) -> None:
    """The directory's entries survive a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
