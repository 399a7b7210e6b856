"""The ``reset`` operation: a used sandbox made pristine for the next one, and checked.

No process but the agent and the zygote, every writable place empty with its mode back and no
extended attributes, no System V IPC object, empty keyrings (or none usable at all:
``deny_keyrings``), and the agent's and the zygote's rlimits, priority and affinity as they were at
start (``procs.process_state``, read from descriptors held open). What cannot be verified says why, and the host
discards the sandbox instead of reusing it.
"""

import os
import sys
import time

from . import ctypes
from .procs import drop_bash_ahead, process_state, reap_strays, read_proc, sigkill_pending, start_bash_ahead

MACHINE = os.uname().machine
#: seccomp's view of the architecture (``AUDIT_ARCH_*``) and the keyring system calls' numbers there
KEYRING_CALLS = {"x86_64": (0xC000003E, (248, 249, 250)), "aarch64": (0xC00000B7, (217, 218, 219))}
#: the 32-bit calls the same kernel takes: i386's (int 0x80) on x86_64, AArch32's (EABI) on aarch64
COMPAT_CALLS = {"x86_64": (0x40000003, (286, 287, 288)), "aarch64": (0x40000028, (309, 310, 311))}
SECCOMP_CALL = {"x86_64": 317, "aarch64": 277}  # seccomp(2): for SECCOMP_FILTER_FLAG_SPEC_ALLOW
X32_BIT = 0x40000000  # x32 system calls on x86_64: refused whole (no interpreter here uses them)
KEYCTL = KEYRING_CALLS[MACHINE][1][2] if MACHINE in KEYRING_CALLS else None  # keyctl(2) here, if known
KEYS_GC_S = 1.0  # how long a reset waits for the keys it unlinked to be destroyed
#: (cmd, offset of the count in the answer): SHM_INFO's ``used_ids``, MSG_INFO's ``msgpool``,
#: SEM_INFO's ``semusz``: how many objects of each kind this IPC namespace holds
IPC_COUNTS = (("shm", 14, 0), ("msg", 12, 0), ("sem", 19, 28))


def op_reset(st, req):
    """Make this sandbox pristine for the next one (``req["dirs"]``: its writable places, path ->
    mode), and check it; ``clean`` False: discard the sandbox. A clean one may then start the next
    run's process ahead (``ahead``: a python child, or a bash), or a session sandbox the next
    session's interpreter (``prefork``)."""
    why = []
    drop_bash_ahead(st)  # (a reset with no run since the last: a new one is started below)
    end_session(st)  # a session's sandbox: its interpreter and shell go first (nothing in a one-shot's)
    if st.tainted:
        why.append(st.tainted)
    reaped, st.reaped = st.reaped, False
    if not reaped and not reap_strays(st):
        why.append("processes survived the reaping")
    for path, mode in (req.get("dirs") or {}).items():
        try:
            os.chmod(path, mode)
            had = wipe(path)
            for name in os.listxattr(path):
                os.removexattr(path, name)
            os.utime(path)
            if had and os.listdir(path):  # (no process is left to make an entry since wipe's scan)
                why.append(f"{path} is not empty")
        except OSError as e:
            why.append(f"{path}: {e}")
    if ipc_clear(st):
        why.append("System V IPC objects are left")
    if not keys_clear(st):
        why.append("keyrings could not be emptied")
    z = st.zygote
    for pid, want in st.snapshot.items():
        if z is None and pid != os.getpid():
            continue
        try:
            now = process_state(st, pid)
        except OSError:
            why.append(f"process {pid} is gone")
            continue
        if now["cpus"] != want["cpus"]:
            try:
                os.sched_setaffinity(pid, want["cpus"])
                now["cpus"] = want["cpus"]
            except OSError:
                pass
        if not want["ending"] and (now["ending"] or pid != os.getpid() and sigkill_pending(st, pid)):
            why.append(f"process {pid} was killed")
        changed = [k for k in want if now[k] != want[k] and k != "ending"]
        if changed:
            why.append(f"process {pid}: {', '.join(changed)} changed")
    if z is not None and z.broken:
        why.append(f"zygote: {z.broken}")
    if not why and req.get("prefork"):  # a session's sandbox: the next session's interpreter, forked now
        from .sessions import prefork_child
        why += prefork_child(st)
    # the next is likely python too; never in a session's sandbox, whose zygote waits on the next
    # session's interpreter (asked to fork ahead then, it could not answer: discarded)
    if not why and z is not None and st.last == "python" and req.get("ahead") and not st.session:
        z.fork_ahead()
        if z.broken:
            why.append(f"zygote: {z.broken}")
    if not why and st.last == "run" and st.last_run is not None and req.get("ahead"):  # likewise a bash one-shot's
        start_bash_ahead(st, *st.last_run)
    return {"clean": not why, "why": "; ".join(why)}


def end_session(st):
    """A session leaves this sandbox: its interpreter, its shell and its packed blob go, and
    nothing of it is remembered (the next session starts as in a fresh sandbox)."""
    if st.child is not None:
        from .sessions import end_child
        end_child(st, "")
    st.lost = ""
    if st.shell is not None:
        st.shell.stop()
    st.shell_used = False
    st.rest_blob = b""
    st.rest_modules = set()
    if st.session:  # (a one-shot sandbox's reset reads it next: its fork-ahead)
        st.last = ""  # the last run's op: nothing of a session's leads the next session's sandbox


def wipe(path):
    """Remove everything under ``path`` (entries the user's code made unreadable included);
    whether there was anything to remove."""
    found = False
    for entry in os.scandir(path):
        found = True
        if entry.is_dir(follow_symlinks=False):
            os.chmod(entry.path, 0o700)
            wipe(entry.path)
            os.rmdir(entry.path)
        else:
            os.unlink(entry.path)
    return found


def snapshot(st, pid=None):
    """Remember ``pid``'s state (default: the agent's) for the resets to compare against."""
    pid = os.getpid() if pid is None else pid
    st.snapshot[pid] = process_state(st, pid)


# -- System V IPC -------------------------------------------------------------------------------------

def ipc_count(st):
    """How many System V IPC objects this IPC namespace holds (three system calls: a reset after
    a run that made none reads no ``/proc/sysvipc`` file); None when it cannot be told."""
    libc = st.libc
    if libc is None:
        return None
    buf = st.ipc_buf = st.ipc_buf or ctypes.create_string_buffer(256)  # the kernel writes each answer whole
    total = 0
    for kind, cmd, at in IPC_COUNTS:
        if kind == "sem":
            ret = libc.semctl(0, 0, cmd, buf)
        else:
            ret = (libc.shmctl if kind == "shm" else libc.msgctl)(0, cmd, buf)
        if ret < 0:
            return None
        total += int.from_bytes(buf.raw[at:at + 4], "little")
    return total


def ipc_clear(st):
    """Remove every System V IPC object of this sandbox's IPC namespace (they outlive processes).
    Counted first (``ipc_count``): nothing to remove when the namespace holds none, which is every
    reset but those after a run that made some, and the counts cost far less than the reads."""
    libc = st.libc
    if libc is None:
        return 1  # cannot look: not verifiably clean
    if ipc_count(st) == 0:
        return 0
    left = 0
    for kind, ctl in (("shm", libc.shmctl), ("msg", libc.msgctl), ("sem", libc.semctl)):
        try:
            rows = read_proc(st, f"/proc/sysvipc/{kind}").decode("ascii", "replace").splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            ident = int(row.split()[1])
            if (ctl(ident, 0, 0, 0) if kind == "sem" else ctl(ident, 0, None)) != 0:  # IPC_RMID
                left += 1
    return left or (ipc_count(st) or 0)


# -- keyrings -----------------------------------------------------------------------------------------

def deny_keyrings(st):
    """Refuse ``add_key``, ``request_key`` and ``keyctl`` (EPERM) to this process and everything
    it starts, by a seccomp filter installed before the zygote exists. The kernel's keyrings are
    not namespaced and every sandbox runs as the same host user: a key one sandbox added would be
    listed (description, serial) in ``/proc/keys`` of every sandbox running at the same time, a
    channel between concurrent one-shots that no reset can close; container runtimes' default
    seccomp profiles refuse these calls for the same reason. The filter checks the native calls,
    the 32-bit ones the same kernel takes (i386's, AArch32's) and x32's; it refuses every call of
    an architecture it does not know. True when it is in place (a machine not listed here, or a
    kernel without seccomp: False, and the reset goes on emptying the keyrings)."""
    libc = st.libc
    if libc is None:
        return False
    import struct
    arch = KEYRING_CALLS.get(MACHINE)
    if arch is None:
        return False
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM

    def calls(numbers, x32):
        """nr (loaded) in ``numbers`` (or an x32 call): deny, else allow."""
        out = [(jge, 0, 1, X32_BIT), (ret, 0, 0, deny)] if x32 else []
        for k, n in enumerate(numbers):
            out.append((jeq, len(numbers) - k, 0, n))  # to the deny at the end
        return out + [(ret, 0, 0, allow), (ret, 0, 0, deny)]

    compat = COMPAT_CALLS[MACHINE]
    native = [(ld, 0, 0, 0)] + calls(arch[1], MACHINE == "x86_64")
    other = [(ld, 0, 0, 0)] + calls(compat[1], False)
    # native calls, then the same kernel's 32-bit ones; any other architecture (none a program here
    # can use) is refused whole rather than let through unchecked
    program = ([(ld, 0, 0, 4), (jeq, 0, len(native), arch[0])] + native
               + [(jeq, 0, len(other), compat[0])] + other + [(ret, 0, 0, deny)])
    blob = b"".join(struct.pack("=HBBI", *ins) for ins in program)
    buf = ctypes.create_string_buffer(blob, len(blob))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Fprog(len(program), ctypes.addressof(buf))
    ul = ctypes.c_ulong
    if libc.prctl(ctypes.c_int(38), ul(1), ul(0), ul(0), ul(0)) != 0:  # PR_SET_NO_NEW_PRIVS: required unprivileged
        return False
    # SECCOMP_SET_MODE_FILTER with SECCOMP_FILTER_FLAG_SPEC_ALLOW: before Linux 5.16 installing a
    # filter also forced the speculative store bypass mitigation on every process of the sandbox
    # (slower user code); the flag keeps the host's choice. Without the seccomp call, prctl's.
    if libc.syscall(ctypes.c_long(SECCOMP_CALL[MACHINE]), ul(1), ul(1 << 2), ctypes.c_void_p(ctypes.addressof(prog))) == 0:
        return True
    return libc.prctl(ctypes.c_int(22), ul(2), ctypes.c_void_p(ctypes.addressof(prog)), ul(0),
                      ul(0)) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def keys_clear(st):
    """Empty the keyrings that outlive a process: the user's, the user-session and persistent ones.
    Each is read first and cleared only when it holds something (the user's holds the persistent
    one once it was asked for, and a fresh sandbox's holds nothing: it is cleared after every run);
    the keys a clear unlinked are then waited for until the kernel's key garbage collector has
    destroyed them (``keys_gone``)."""
    if st.keys_denied:
        return True  # no process of this sandbox could add a key (``deny_keyrings``)
    libc = st.libc
    if libc is None or KEYCTL is None:
        return False  # cannot clear them here (no ctypes, or an architecture we have no syscall number for)
    ok = True
    c = ctypes.c_long
    op, read = c(KEYCTL), c(11)
    rings = []
    persistent = libc.syscall(op, c(22), c(-1), c(-4))  # KEYCTL_GET_PERSISTENT, linked to @u
    if persistent > 0:
        rings.append(persistent)
    rings += [-4, -5]  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
    unlinked = []
    ours = None
    for ring in rings:
        size = libc.syscall(op, read, c(ring), None, c(0))  # KEYCTL_READ: 4 bytes a linked key
        if size == 0:  # empty: nothing to clear
            continue
        if ours is None:  # (the persistent one is by its serial: not searchable, it has no ID to ask)
            if not st.ring_ids:  # fixed for the sandbox's user namespace: asked once
                st.ring_ids.update({r: libc.syscall(op, c(0), c(r), c(0)) & 0xFFFFFFFF for r in (-4, -5)})
            ours = {persistent & 0xFFFFFFFF, *st.ring_ids.values()}
        if size > 0:
            buf = ctypes.create_string_buffer(size)
            got = libc.syscall(op, read, c(ring), buf, c(size))
            unlinked += [int.from_bytes(buf.raw[i:i + 4], sys.byteorder) for i in range(0, max(0, min(got, size)), 4)]
        if libc.syscall(op, c(7), c(ring)) != 0 and ctypes.get_errno() not in (38, 1, 13, 126):
            ok = False  # KEYCTL_CLEAR failed for another reason than "no keyrings here"
        size = libc.syscall(op, read, c(ring), None, c(0))
        if size > 0:
            ok = False
    # the keyrings themselves are linked into each other (the user's into the user-session one, the
    # persistent one into the user's by KEYCTL_GET_PERSISTENT above): they live on, only what a run
    # added must go
    unlinked = [serial for serial in unlinked if serial not in (ours or ())]
    return ok and (not unlinked or keys_gone(st, unlinked))


def keys_gone(st, serials, timeout_s=KEYS_GC_S):
    """Whether the keys ``serials`` are gone from ``/proc/keys``, waiting for it. An unlinked key
    is destroyed by the kernel's garbage collector, asynchronously: it may stay listed for some
    milliseconds after its keyring's clear, its description readable there by the next run."""
    wanted = {b"%08x" % serial for serial in serials}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            listed = {row.split(None, 1)[0] for row in read_proc(st, "/proc/keys").splitlines() if row}
        except OSError:  # no /proc/keys here: nothing lists them
            return True
        if not wanted & listed:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
