"""A layer's tar as a stream: decompressed and hashed in a thread of its own, split into members here.

``Inflated(read)`` runs the decompression (gzip, zstd or none, sniffed from the first bytes) and
the sha256 of the uncompressed tar (the layer's diff_id) in a thread, handing chunks of at most
``OUT`` bytes to the reader through a short queue; zlib, zstd and hashlib let go of the GIL while
they work, so on a machine with cores to spare that work runs beside the unpacking. ``TarStream``
reads those chunks as members (``tarfile.TarInfo``s, as the store's checks take them) and hands
each regular file's data as slices of the chunks, copied nowhere: ``tarfile``'s stream mode
costs several times as much per member (a buffered reader per file, a header parsed field by
field through generic helpers), and a root filesystem layer is thousands of small files.

What ``TarStream`` reads is what ``tarfile`` and Go's ``archive/tar`` read: ustar, GNU and pax
headers, GNU long names and long links, pax global headers, numbers in octal or base-256, a
directory as a regular file whose name ends in ``/``, the ustar prefix only in a POSIX ustar
header (as Go, which wrote most layers). It is stricter where they differ: a header whose
checksum is wrong is an error, not the end of the archive, and sparse files (which no image
builder writes) are refused. The store's checks (``unpack.Checker``) then judge each member.

Errors are ``BadLayer`` without the layer's name; the store adds it.
"""

from __future__ import annotations

import hashlib
import queue
import re
import tarfile
import threading
from collections import deque
from typing import Callable, Iterator

try:  # ISA-L's inflate: the same API as zlib's, two to three times as fast
    from isal import isal_zlib as _inflate_mod
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from zlib_ng import zlib_ng as _inflate_mod
    except ImportError:
        import zlib as _inflate_mod

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
GZIP_MAGIC = b"\x1f\x8b"
IN = 1 << 20  # compressed bytes read at once
OUT = 1 << 20  # at most this many uncompressed bytes in one chunk (a small layer may expand to any size)
BLOCK = 512
_ZERO = bytes(BLOCK)
INFLATE = getattr(_inflate_mod, "__name__", "zlib").rpartition(".")[2]  # which inflate runs (for the bench)


class BadLayer(ValueError):
    """The layer is not a readable tar (the message does not name the layer)."""


def _corrupt(what: str) -> BadLayer:
    return BadLayer(f"not a readable tar (truncated or corrupt: {what})")


# -- decompression ---------------------------------------------------------------------------------

def inflate(read: Callable[[int], bytes]) -> Iterator[bytes]:
    """The uncompressed bytes of the layer ``read`` returns (``read(n)``: up to n bytes, b"" at
    its end), in chunks of at most ``OUT`` bytes."""
    head = b""
    while len(head) < 6:
        more = read(6 - len(head))
        if not more:
            break
        head += more
    if head[:2] == GZIP_MAGIC:
        yield from _gunzip(head, read)
    elif head[:4] == ZSTD_MAGIC:
        yield from _unzstd(head, read)
    else:
        if head:
            yield head
        while True:
            data = read(OUT)
            if not data:
                return
            yield data


def _gunzip(data: bytes, read: Callable[[int], bytes]) -> Iterator[bytes]:
    """gzip's members one after another (zero bytes between them are padding, as gzip reads it)."""
    d = _inflate_mod.decompressobj(31)
    try:
        while True:
            if not data:
                data = read(IN)
                if not data:
                    if d is not None:
                        raise _corrupt("the gzip stream ends early")
                    return
            if d is None:  # after a member: padding, or the next member
                data = data.lstrip(b"\0")
                if not data:
                    continue
                if data[:1] != GZIP_MAGIC[:1] or (len(data) > 1 and data[:2] != GZIP_MAGIC):
                    raise _corrupt("bytes that are not gzip follow the gzip stream")
                d = _inflate_mod.decompressobj(31)
            while True:
                out = d.decompress(data, OUT)
                data = d.unconsumed_tail
                if out:
                    yield out
                # input all taken and less than a chunk out: nothing is held back inside
                if d.eof or (not data and len(out) < OUT):
                    break
            if d.eof:
                data, d = d.unused_data, None
    except _inflate_mod.error as e:
        raise _corrupt(f"bad gzip data: {e}") from None


def _unzstd(head: bytes, read: Callable[[int], bytes]) -> Iterator[bytes]:
    try:
        import zstandard
    except ImportError:
        raise BadLayer("a zstd-compressed layer needs the zstandard package (pip install zstandard)") from None
    # read_across_frames: a layer may be written as several frames (one per chunk)
    reader = zstandard.ZstdDecompressor().stream_reader(_Prefixed(head, read), read_across_frames=True)
    while True:
        try:
            out = reader.read(OUT)
        except zstandard.ZstdError as e:
            raise _corrupt(f"bad zstd data: {e}") from None
        if not out:
            return
        yield out


class _Prefixed:
    """``head``, then what ``read`` returns: as a file for zstandard's reader."""

    def __init__(self, head: bytes, read: Callable[[int], bytes]) -> None:
        self.head, self._read = head, read

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out, self.head = (self.head, b"") if n < 0 or n >= len(self.head) else (self.head[:n], self.head[n:])
            return out
        return self._read(IN if n < 0 else n)


class Inflated:
    """``inflate(read)`` in a thread of its own, hashed as it goes in another (the two run side
    by side where there are cores: a layer's sha256 costs a third of its inflate): iterate for
    the chunks; ``digest`` and ``count`` (the uncompressed tar's sha256 and length) once
    iteration ended. At most ``depth`` chunks wait for the reader, and as many for the hash.
    A failure of ``read`` or of the decompression is raised by the iteration; ``close`` stops
    the thread at its next chunk (one blocked in ``read`` ends when ``read`` returns or raises)."""

    def __init__(self, read: Callable[[int], bytes], depth: int = 8) -> None:
        self._read, self.depth = read, depth
        self.sha = hashlib.sha256()
        self.count = 0
        self._cv = threading.Condition()
        self._chunks: deque[bytes] = deque()
        self._done = False
        self._stopped = False
        self._error: BaseException | None = None
        self._to_hash: queue.Queue = queue.Queue(depth)
        self._hasher = threading.Thread(target=self._hash, name="tangram-hash", daemon=True)
        self._hasher.start()
        threading.Thread(target=self._run, name="tangram-inflate", daemon=True).start()

    def _hash(self) -> None:
        while True:
            chunk = self._to_hash.get()
            if chunk is None:
                return
            self.sha.update(chunk)

    def _run(self) -> None:
        try:
            for chunk in inflate(self._read):
                self._to_hash.put(chunk)
                self.count += len(chunk)
                with self._cv:
                    while len(self._chunks) >= self.depth and not self._stopped:
                        self._cv.wait()
                    if self._stopped:
                        return
                    self._chunks.append(chunk)
                    self._cv.notify_all()
        except BaseException as e:  # handed to the reader
            self._error = e
        finally:
            self._to_hash.put(None)
            with self._cv:
                self._done = True
                self._cv.notify_all()

    def __iter__(self) -> "Inflated":
        return self

    def __next__(self) -> bytes:
        with self._cv:
            while not self._chunks and not self._done:
                self._cv.wait()
            if self._chunks:
                chunk = self._chunks.popleft()
                self._cv.notify_all()
                return chunk
            if self._error is not None:
                raise self._error
            raise StopIteration

    def digest(self) -> str:
        self._hasher.join()  # every chunk hashed (iteration ended: the last one was queued)
        return self.sha.hexdigest()

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._chunks.clear()
            self._cv.notify_all()


# -- members ---------------------------------------------------------------------------------------

_REGULAR = frozenset(tarfile.REGULAR_TYPES)
_SUPPORTED = frozenset(tarfile.SUPPORTED_TYPES)
_PAX = (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE)
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
_PAX_INT = {"size", "uid", "gid"}
_PAX_NAMES = {"path", "linkpath", "uname", "gname"}


def _nts(b: bytes) -> str:
    p = b.find(b"\0")
    return (b if p < 0 else b[:p]).decode("utf-8", "surrogateescape")


def _nti(b: bytes) -> int:
    if b[0] in (0o200, 0o377):  # base-256 (GNU): big numbers, negative ones
        n = int.from_bytes(b[1:], "big")
        return n - 256 ** (len(b) - 1) if b[0] == 0o377 else n
    try:  # the usual field: octal digits (perhaps padded with spaces), then one NUL
        return int(b[:-1], 8)
    except ValueError:
        pass
    p = b.find(b"\0")
    s = (b if p < 0 else b[:p]).strip()
    try:
        return int(s, 8) if s else 0
    except ValueError:
        raise _corrupt("a header field is not a number") from None


def _checksum_ok(buf: bytes) -> bool:
    field = buf[148:156]
    try:  # six digits, NUL, space (as most writers put it)
        want = int(field[:6], 8) if field[6:] == b"\0 " else _nti(field)
    except ValueError:
        want = _nti(field)
    unsigned = sum(buf) - sum(field) + 256  # the field itself counted as eight spaces
    if want == unsigned:
        return True
    high = sum(1 for c in buf[:148] + buf[156:] if c > 127)
    return want == unsigned - 256 * high  # some tars sum signed chars


class TarStream:
    """The members of the tar whose bytes ``chunks`` yields, in order (iterate). A regular file's
    data is ``data()`` (slices of the chunks), read before the next member is asked for, or
    skipped. ``end``: the offset of the end-of-archive block, once iteration ended there."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""
        self._pos = 0
        self.offset = 0  # of the next byte not read yet
        self._pending = 0  # data of the current member not read yet
        self._pad = 0  # and its padding to the block
        self._globals: dict[str, str] = {}
        self.end: int | None = None

    def _fill(self) -> bool:
        for chunk in self._chunks:
            if chunk:
                self._buf, self._pos = chunk, 0
                return True
        self._buf, self._pos = b"", 0
        return False

    def _take(self, n: int) -> bytes:
        """Exactly ``n`` bytes (fewer only at the end of the stream)."""
        pos = self._pos
        if len(self._buf) - pos >= n:
            self._pos = pos + n
            self.offset += n
            return self._buf[pos:pos + n]
        parts = [self._buf[pos:]]
        got = len(parts[0])
        while got < n and self._fill():
            piece = self._buf[:n - got]
            self._pos = len(piece)
            parts.append(piece)
            got += len(piece)
        self.offset += got
        return b"".join(parts)

    def _skip(self, n: int) -> None:
        while n:
            have = len(self._buf) - self._pos
            if not have and not self._fill():
                raise _corrupt("it ends inside a member")
            step = min(n, len(self._buf) - self._pos)
            self._pos += step
            self.offset += step
            n -= step

    def data(self) -> Iterator[memoryview]:
        """The current member's data, in pieces; then its padding is skipped."""
        while self._pending:
            have = len(self._buf) - self._pos
            if not have:
                if not self._fill():
                    raise _corrupt("it ends inside a member")
                have = len(self._buf)
            step = min(have, self._pending)
            pos = self._pos
            self._pos = pos + step
            self.offset += step
            self._pending -= step
            yield memoryview(self._buf)[pos:pos + step]
        if self._pad:
            pad, self._pad = self._pad, 0
            self._skip(pad)

    def __iter__(self) -> Iterator[tarfile.TarInfo]:
        while True:
            m = self._next()
            if m is None:
                return
            yield m

    def _next(self) -> tarfile.TarInfo | None:
        if self._pending or self._pad:
            self._skip(self._pending + self._pad)
            self._pending = self._pad = 0
        pax: dict[str, str] | None = None
        long_name: str | None = None
        long_link: str | None = None
        while True:
            at = self.offset
            buf = self._take(BLOCK)
            if len(buf) < BLOCK:
                raise _corrupt("it ends inside a block or has no end-of-archive marker")
            if buf == _ZERO:
                if pax is not None or long_name is not None or long_link is not None:
                    raise _corrupt("an extended header is followed by the end of the archive")
                self.end = at
                return None
            if not _checksum_ok(buf):
                raise _corrupt(f"a header with a bad checksum at byte {at}")
            kind = buf[156:157]
            try:  # the usual field (octal digits, one NUL) read in place: a call less per member
                size = int(buf[124:135], 8)
            except ValueError:
                size = _nti(buf[124:136])
            if size < 0:
                raise _corrupt(f"a member of negative size at byte {at}")
            if kind in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
                text = _nts(self._block_data(size))
                if kind == tarfile.GNUTYPE_LONGNAME:
                    long_name = text
                else:
                    long_link = text
                continue
            if kind in _PAX or kind == tarfile.XGLTYPE:
                records = self._pax(self._block_data(size))
                if kind == tarfile.XGLTYPE:
                    self._globals.update(records)
                else:
                    pax = {**(pax or {}), **records}
                continue
            if kind == tarfile.GNUTYPE_SPARSE:
                raise BadLayer(f"member {_nts(buf[0:100])!r} is a sparse file (not supported)")
            return self._member(buf, kind, size, pax, long_name, long_link)

    def _block_data(self, size: int) -> bytes:
        if size > 16 << 20:
            raise _corrupt(f"an extended header of {size} bytes")
        data = self._take(size)
        if len(data) < size:
            raise _corrupt("it ends inside an extended header")
        self._skip(-size % BLOCK)
        return data

    def _pax(self, buf: bytes) -> dict[str, str]:
        charset = re.search(rb"\d+ hdrcharset=([^\n]+)\n", buf)
        binary = charset is not None and charset.group(1) == b"BINARY"
        out: dict[str, str] = {}
        pos = 0
        while True:
            match = _PAX_RECORD.match(buf, pos)
            if not match:
                break
            length = int(match.group(1))
            if length <= 0:
                raise _corrupt("a pax record of length 0")
            key = match.group(2).decode("utf-8", "surrogateescape")
            raw = buf[match.end(2) + 1:match.start(1) + length - 1]
            try:
                value = raw.decode("utf-8")
            except UnicodeDecodeError:
                value = raw.decode("utf-8", "surrogateescape")
            if binary and key in _PAX_NAMES:
                value = raw.decode("utf-8", "surrogateescape")
            if key.startswith("GNU.sparse."):
                raise BadLayer("a sparse file (pax GNU.sparse records: not supported)")
            out[key] = value
            pos += length
        return out

    def _member(self, buf: bytes, kind: bytes, size: int, pax: dict[str, str] | None, long_name: str | None,
                long_link: str | None) -> tarfile.TarInfo:
        name = _nts(buf[0:100])
        if buf[257:263] == b"ustar\0" and buf[345]:  # POSIX ustar's prefix (GNU's header keeps times there)
            name = _nts(buf[345:500]) + "/" + name
        if kind == tarfile.AREGTYPE and name.endswith("/"):
            kind = tarfile.DIRTYPE
        m = tarfile.TarInfo()
        m.type = kind
        m.name = long_name if long_name is not None else name
        m.linkname = long_link if long_link is not None else _nts(buf[157:257])
        try:  # the usual fields, read in place (``_nti`` is for the rest: base-256, spaces, NULs)
            m.mode, m.uid, m.gid, m.mtime = int(buf[100:107], 8), int(buf[108:115], 8), int(buf[116:123], 8), \
                int(buf[136:147], 8)
        except ValueError:
            m.mode, m.uid, m.gid, m.mtime = _nti(buf[100:108]), _nti(buf[108:116]), _nti(buf[116:124]), \
                _nti(buf[136:148])
        m.size = size
        records = {**self._globals, **pax} if pax else self._globals
        for key, value in records.items():
            if key == "path":
                m.name = value.rstrip("/")
            elif key == "linkpath":
                m.linkname = value
            elif key in _PAX_INT:
                try:
                    setattr(m, key, int(value))
                except ValueError:
                    raise _corrupt(f"pax record {key}={value[:40]!r} is not a number") from None
            elif key == "mtime":
                try:
                    m.mtime = float(value)
                except ValueError:
                    raise _corrupt(f"pax record mtime={value[:40]!r} is not a number") from None
        if m.size < 0:
            raise _corrupt(f"member {m.name!r} has a negative size")
        if kind == tarfile.DIRTYPE:
            m.name = m.name.rstrip("/")
        if kind in _REGULAR or kind not in _SUPPORTED:  # as tarfile and Go: others carry no data
            self._pending, self._pad = m.size, -m.size % BLOCK
        return m
