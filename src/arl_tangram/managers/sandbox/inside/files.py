"""Files the agent opens for the host (``write``, ``read``, and ``fs``'s reads and writes): plain
ones only.

A path the host names may pass through links the sandbox's code planted, and this process follows
them with its own rights: to its own descriptors through /proc/1/fd (a workspace link to
/proc/1/fd/4, written through, would put the caller's bytes on the agent's answer channel to the
host), to its memory map, its limits. So a path is opened without magic links (openat2's
RESOLVE_NO_MAGICLINKS, Linux 5.6+; without it, the file must not be one this process holds open),
and only a regular file outside the kernel's pseudo file systems is read or written.
"""

import os

from . import b64, ctypes, unb64, write_all

SYS_OPENAT2 = 437  # one number on every architecture (it came after the tables were unified)
RESOLVE_NO_MAGICLINKS = 0x02
PSEUDO_FS = frozenset(("proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "bpf", "configfs",
                       "binfmt_misc", "fusectl", "pstore", "efivarfs", "mqueue", "devpts"))
#: all the files one read returns, together (each is capped at ``max_bytes``, 16 MiB): the answer is
#: one line of the host's channel (64 MiB), base64 a third larger; four 14 MiB files would overflow
#: it, and the run a program's own files made would end ``infra_error``
READ_TOTAL = 40 << 20


class NotPlain(OSError):
    """Not a regular file of an ordinary file system: never read or written for the host."""


def pseudo_devs(st):
    """The devices of the pseudo file systems this sandbox has mounted (read once: nothing in
    the sandbox can change this process's mounts)."""
    if st.pseudo_devs is None:
        devs = set()
        try:
            with open("/proc/self/mountinfo", "rb") as f:
                for line in f.read().decode("utf-8", "replace").splitlines():
                    head, _, tail = line.partition(" - ")
                    fields = head.split()
                    if len(fields) > 2 and tail.split(" ", 1)[0] in PSEUDO_FS:
                        major, _, minor = fields[2].partition(":")
                        devs.add(os.makedev(int(major), int(minor)))
        except (OSError, ValueError):  # no /proc mounted: none of its files to keep from the host
            pass                       # (not /sys's device by its path: an empty /sys on the root tmpfs
        st.pseudo_devs = frozenset(devs)  # would make every link there look like a pseudo file's)
    return st.pseudo_devs


def open_no_magic(st, path, flags, mode):
    if "\0" in path:  # (ctypes would cut the path there, where os.open refuses it)
        raise ValueError(f"{path!r}: a path with a NUL byte")
    if st.openat2:
        call = openat2_call(st)
        how = st.hows.get((flags, mode))
        if how is None:  # a handful of (flags, mode): each made once
            how = st.hows[(flags, mode)] = st.hows["struct"](flags, mode if flags & os.O_CREAT else 0,
                                                             RESOLVE_NO_MAGICLINKS)
        fd = call(SYS_OPENAT2, -100, os.fsencode(path), ctypes.addressof(how), 24)  # sizeof(struct open_how)
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err == 40:  # ELOOP: what RESOLVE_NO_MAGICLINKS answers (or a loop of links)
            raise NotPlain(err, "a link into a process's own files (/proc/<pid>/fd...), or a loop of links", path)
        if err not in (38, 1):  # ENOSYS: an older kernel; EPERM: a container's filter that refuses it (then
            raise OSError(err, os.strerror(err), path)  # every open goes the other way, ``held_here``)
        st.openat2 = False
    return os.open(path, flags, mode)


def openat2_call(st):
    """The typed ``syscall(SYS_openat2, ...)``, made on first use: a sandbox's start would
    otherwise pay for the ctypes prototype before its first request."""
    call = st.hows.get("call")
    if call is None:
        class OpenHow(ctypes.Structure):
            _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

        # syscall(SYS_openat2, AT_FDCWD, path, &how, sizeof how)
        prototype = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                                     ctypes.c_size_t, use_errno=True)
        call = st.hows["call"] = prototype(("syscall", st.libc))
        st.hows["struct"] = OpenHow
    return call


def held_here(fd, st_):
    """``st_`` (a stat result) is a file this process holds open under another descriptor."""
    for name in os.listdir("/proc/self/fd"):
        if name == str(fd):
            continue
        try:
            other = os.stat(int(name))
        except (OSError, ValueError):
            continue
        if other.st_ino == st_.st_ino and other.st_dev == st_.st_dev:
            return True
    return False


def open_plain(st, path, flags, mode=0o666, truncate=False):
    """``path`` opened for the host (``flags``: O_RDONLY, or O_WRONLY and O_CREAT; ``truncate``:
    emptied once it is known to be plain, never at the open), or ``NotPlain``/``OSError``."""
    fd = open_no_magic(st, path, flags | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY, mode)
    try:
        got = os.fstat(fd)
        if ((got.st_mode & 0o170000) != 0o100000 or got.st_dev in pseudo_devs(st)
                or (not st.openat2 and held_here(fd, got))):
            raise NotPlain(22, "not a plain file (a regular file outside /proc and /sys)", path)
        if truncate and got.st_size:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def in_workspace(st, path):
    full = os.path.normpath(os.path.join(st.workspace, path))
    if full != st.workspace and not full.startswith(st.workspace + "/"):
        raise ValueError(f"{path!r} is outside the workspace")
    return full


def op_write(st, req):
    """Write files into the workspace (their directories made first). Raw descriptors, and no
    directory made for a file directly in the workspace (a bash one-shot's ``main.sh``: this write
    is most of the agent's CPU before a bash run); the mode of ``open(path, "wb")``, a regular file
    only (``open_plain``), truncated once that is known."""
    for path, data in (req.get("files") or {}).items():
        full = in_workspace(st, path)
        parent = os.path.dirname(full)
        if parent != st.workspace:
            os.makedirs(parent, exist_ok=True)
        fd = open_plain(st, full, os.O_WRONLY | os.O_CREAT, truncate=True)
        try:
            write_all(fd, unb64(data))
        finally:
            os.close(fd)
    return {}


def read_past(fd, limit):
    """At most ``limit`` + 1 bytes of ``fd``: the byte past ``limit`` says whether it was cut."""
    chunks, got = [], 0
    while got <= limit:
        chunk = os.read(fd, limit + 1 - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def op_read(st, req):
    """The files at ``paths`` (workspace-relative), each cut at ``max_bytes`` and all of them at
    ``READ_TOTAL`` together (``cut`` names those cut); what is not a regular file is ``missing``,
    never read (a FIFO would block the read until the run's deadline, /dev/zero give 16 MiB)."""
    limit = int(req.get("max_bytes") or 1 << 24)
    left = READ_TOTAL
    files, missing, cut = {}, [], []
    for path in req.get("paths") or []:
        try:
            fd = open_plain(st, in_workspace(st, path), os.O_RDONLY)  # a FIFO, a device, a link to /proc/1: missing
        except (OSError, ValueError):
            missing.append(path)
            continue
        try:
            want = min(limit, left)
            data = read_past(fd, want)
            if len(data) > want:
                data = data[:want]
                cut.append(path)
            left -= len(data)
            files[path] = b64(data)
        except OSError:
            missing.append(path)
        finally:
            os.close(fd)
    return {"files": files, "missing": missing, **({"cut": cut} if cut else {})}
