"""Rest and wake: a session's python state and files to bytes (``rest``, ``rest_chunk``), and
back (``wake``).

A session idle long enough is put to rest by its host (manager.py): ``rest`` packs its
interpreter's namespace (``pickling.pack_here``, in the interpreter) and the sandbox's tmpfs files
(``_pack``) into one blob the host fetches in chunks and keeps on disk; the sandbox is then reset
for another session (or killed). ``wake``, in a sandbox of the same kind, loads it back (the files
here, the namespace in a new interpreter). What cannot be carried is named in ``dropped``.
"""

import binascii
import marshal
import os
import time

from . import b64, unb64, write_all
from .sessions import CHILD_LINE_MAX, LATE_PACK, REST_CHILD_S, child_call, end_child, start_child

REST_INLINE = 256 << 10  # a blob up to this size rides on the rest's own answer
REST_CHUNK = 4 << 20  # bytes per answer line (base64: ~5.6 MB; the host reads lines up to 64 MB)
# bash prints a script that re-creates its state: variables (not bash's own or read-only ones),
# functions, aliases, options, the directory. Traps and the job table are not carried (a step's
# background jobs are reaped when it ends anyway).
SHELL_SAVE = r"""for __v in $(compgen -v); do
  case $__v in BASH*|PPID|SHLVL|RANDOM|SRANDOM|SECONDS|LINENO|HISTCMD|FUNCNAME|GROUPS|PIPESTATUS|_|PWD|OLDPWD|\
    EPOCH*|UID|EUID|SHELLOPTS|COMP*|DIRSTACK|__v|__d|__f) continue;; esac
  __d=$(declare -p "$__v" 2>/dev/null) || continue
  __f=${__d#declare }; __f=${__f%% *}
  case $__f in *r*) continue;; esac
  printf '%s\n' "$__d"
done
declare -f; alias -p; shopt -p; set +o | grep -v -e monitor -e history -e emacs -e vi
printf 'cd -- %q\n' "$PWD"
"""
#: the deepest directory a rest packs (the walk holds a descriptor per level): deeper is dropped, named
PACK_DEPTH = 256
_AT = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # an entry opened under its directory


def op_rest(st, req):
    """Pack this session (``roots``: the tmpfs directories whose files go with it, ``workspace``
    for the workspace) and answer its size and what cannot be carried; the host then fetches the
    blob with ``rest_chunk``. A session whose interpreter had ended packs no namespace and says so
    (``dropped["(namespace)"]``): its wake never looks like the state it lost."""
    dropped = {}
    child_state, modules = None, []
    if st.child is not None and st.child.used:  # (one forked ahead holds nothing of the session's)
        r = child_call(st, {"op": "pack"}, REST_CHILD_S, late=LATE_PACK, line_max=CHILD_LINE_MAX)
        ok = (r is not None and isinstance(r.get("state"), str) and _str_dict(r.get("dropped"))
              and isinstance(r.get("modules"), list) and all(isinstance(m, str) for m in r["modules"]))
        if ok:
            try:
                child_state = unb64(r["state"])
            except binascii.Error:
                ok = False
        if ok:
            dropped.update(r["dropped"])
            modules = r["modules"]
        else:
            if st.child is not None:
                end_child(st, "answered a malformed state")
            child_state = None
    if child_state is None and st.lost:
        dropped["(namespace)"] = f"the session's python interpreter {st.lost} before its rest: its variables were lost"
    files = {}
    for token in req.get("roots") or ():
        root = _rest_root(st, token)
        entries, skipped = _pack(root)
        files[token] = entries
        for rel, why in skipped.items():
            dropped[os.path.join(root, rel)] = why
    shell = None
    if st.shell is not None and st.shell_used and st.shell.alive():  # a shell no step of the session used holds nothing
        if st.shell.name == "bash":
            from .shell import op_shell
            r = op_shell(st, {"command": SHELL_SAVE, "timeout_s": 10, "max_output": 16 << 20})
            if r.get("exit_code") == 0 and not r.get("truncated"):
                shell = unb64(r["stdout"])
        if shell is None:
            dropped["(shell)"] = "the persistent shell's variables, functions and directory end with its process"
    blob = marshal.dumps({"v": 2, "child": child_state, "files": files, "dropped": dropped, "shell": shell}, 4)
    st.rest_blob = blob
    answer = {"size": len(blob), "dropped": dropped, "modules": modules}
    if len(blob) <= REST_INLINE:  # most sessions: the blob in this answer, no ``rest_chunk`` round trip
        answer["data"] = b64(blob)
    return answer


def op_rest_chunk(st, req):
    off = int(req["offset"])
    return {"data": b64(st.rest_blob[off:off + REST_CHUNK])}


def op_wake(st, req):
    """Append a chunk of a rested session's blob; with ``last``, load it: the files back in their
    tmpfs, the namespace in a new session interpreter (and what could not be carried, named)."""
    start = time.monotonic()
    st.rest_blob += unb64(req.get("data"))
    if not req.get("last"):
        return {}
    blob, st.rest_blob = st.rest_blob, b""
    state = marshal.loads(blob)
    dropped = dict(state["dropped"])
    for token, entries in state["files"].items():
        root = _rest_root(st, token)
        dropped.update({os.path.join(root, rel): why for rel, why in _unpack(root, entries).items()})
    child_state = state.get("child")
    if "ns" in state:  # a blob of an agent before sessions had their own interpreter
        child_state = marshal.dumps({k: state[k] for k in ("ns", "cwd", "environ", "path")}, 4)
    names = 0
    if child_state is not None:
        if st.child is not None and st.child.used:  # a sandbox for a wake is pristine: only defence
            end_child(st, "was replaced by a woken session's")
        st.lost = ""
        start_child(st)
        r = child_call(st, {"op": "load", "state": child_state}, REST_CHILD_S, late=LATE_PACK)
        if r is None or not _str_dict(r.get("dropped")) or type(r.get("names")) is not int:
            if st.child is not None:
                end_child(st, "answered a malformed load")
            st.lost = ""  # said here, in what the wake dropped
            dropped["(namespace)"] = "could not be loaded: the session's python interpreter ended while loading it"
        else:
            dropped.update(r["dropped"])
            names = r["names"]
    if state.get("shell"):  # a new bash, brought to where the old one was
        from .shell import op_shell
        r = op_shell(st, {"command": state["shell"].decode("utf-8", "surrogateescape"), "timeout_s": 10})
        if r.get("error") or r.get("exit_code") != 0:
            why = r.get("error") or unb64(r.get("stderr")).decode(errors="replace").strip()[-300:]
            dropped["(shell)"] = f"its state was not restored in full: {why or r.get('note') or r.get('exit_code')}"
    answer = {"dropped": dropped, "names": names, "load_s": time.monotonic() - start}
    if req.get("then"):  # the step that woke the session: its cell, without another round trip
        from .procs import reap_strays
        from .sessions import op_cell
        answer["then"] = op_cell(st, req["then"])
        reap_strays(st)
    return answer


def _str_dict(value):
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _rest_root(st, token):
    """``workspace`` is this sandbox's workspace (its path differs between sandboxes without isolation)."""
    return st.workspace if token == "workspace" else token


def _pack(root):
    """The files under ``root``: [(relative path, kind, mode, mtime, data)], and what was left out.

    Walked by directory descriptors, each entry opened under its directory never following a link
    (``_AT``) and checked to be what its ``lstat`` said: the session's interpreter runs while its
    sandbox is packed, and a directory swapped for a link to /proc/1/fd between the listing and
    the read would lead this process (PID 1) into its own descriptors; a file leased by the
    sandbox's code is skipped (non-blocking), not waited on for the kernel's 45 s. Iterative: a
    tree a thousand directories deep is packed to ``PACK_DEPTH``, not a RecursionError that would
    leave the session awake for good."""
    import stat
    entries, skipped = [], {}
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return entries, {".": f"{type(e).__name__}: {e}"}
    stack = [(top, "", None)]
    while stack:
        fd, rel, names = stack[-1]
        if names is None:
            try:
                names = sorted(os.listdir(fd))
            except OSError as e:
                skipped[rel or "."] = f"{type(e).__name__}: {e}"
                names = []
            if not rel and root == "/tmp":  # the persistent shell's pipes (shellio.DIR), whatever is there
                names = [n for n in names if n != ".tangram-shell"]
            names.reverse()
            stack[-1] = (fd, rel, names)
        if not names:
            os.close(fd)
            stack.pop()
            continue
        name = names.pop()
        path = f"{rel}/{name}" if rel else name
        try:
            got = os.stat(name, dir_fd=fd, follow_symlinks=False)
            mode = stat.S_IMODE(got.st_mode)
            if stat.S_ISDIR(got.st_mode):
                entries.append((path, "d", mode, got.st_mtime, b""))
                if len(stack) > PACK_DEPTH:
                    skipped[path + "/"] = f"deeper than {PACK_DEPTH} directories"
                    continue
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _AT, dir_fd=fd)
                if _same(sub, got):
                    stack.append((sub, path, None))
                else:
                    os.close(sub)
                    skipped[path] = "changed while it was packed"
            elif stat.S_ISLNK(got.st_mode):
                entries.append((path, "l", mode, got.st_mtime, os.fsencode(os.readlink(name, dir_fd=fd))))
            elif stat.S_ISREG(got.st_mode):
                entries.append((path, "f", mode, got.st_mtime, _read_entry(fd, name, got)))
            else:
                skipped[path] = "not a regular file, directory or link"
        except OSError as e:
            skipped[path] = f"{type(e).__name__}: {e}"
    return entries, skipped


def _same(fd, expected):
    """The descriptor is of the file ``expected`` (a stat result) describes (nothing was swapped in between)."""
    got = os.fstat(fd)
    return (got.st_ino == expected.st_ino and got.st_dev == expected.st_dev
            and (got.st_mode & 0o170000) == (expected.st_mode & 0o170000))


def _read_entry(dir_fd, name, expected):
    """A regular file's bytes, opened under its directory (made readable for the owner first if it
    was not, through a descriptor of the file itself, never a path)."""
    if not expected.st_mode & 0o400:
        where = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if not _same(where, expected):
                raise OSError(16, "changed while it was packed", name)
            os.chmod(f"/proc/self/fd/{where}", (expected.st_mode & 0o7777) | 0o400)
        finally:
            os.close(where)
    fd = os.open(name, os.O_RDONLY | _AT, dir_fd=dir_fd)
    try:
        if not _same(fd, expected):
            raise OSError(16, "changed while it was packed", name)
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def _unpack(root, entries):
    """The packed files back under ``root``; what could not be made, by path.

    Made under directory descriptors, never through a link: directories and files first, each
    file created afresh (``O_EXCL``, not following a link), the links last, then the directories'
    modes, deepest first (a read-only directory after its files). A file the blob places under an
    entry packed as a link (a tree swapped while it was packed) would be written through that
    link, possibly into /proc/1/fd, the answer channel: such a file is dropped, named."""
    import stat
    dropped, dirs, links = {}, [], []
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    opened = {"": top}

    def parent(path):
        """The descriptor of ``path``'s directory, each level opened without following a link."""
        head, _, name = path.rpartition("/")
        fd = opened.get(head)
        if fd is None:
            up, base = parent(head)
            fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | _AT, dir_fd=up)
            if len(opened) > 64:  # a descriptor per directory, not a thousand at once
                for k in [k for k in opened if k]:
                    os.close(opened.pop(k))
            opened[head] = fd
        return fd, name

    def clear(fd, name):
        """What the fresh sandbox has at ``name`` gives way (a directory stays: it is merged)."""
        try:
            got = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(got.st_mode):
            os.unlink(name, dir_fd=fd)

    try:
        for rel, kind, mode, mtime, data in entries:
            try:
                fd, name = parent(rel)
                if kind == "d":
                    clear(fd, name)
                    try:
                        os.mkdir(name, 0o700, dir_fd=fd)
                    except FileExistsError:
                        pass
                    dirs.append((rel, mode, mtime))
                elif kind == "l":
                    links.append((rel, data))
                else:
                    clear(fd, name)
                    f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _AT, 0o600, dir_fd=fd)
                    try:
                        write_all(f, data)
                        os.fchmod(f, mode)
                        os.utime(f, (mtime, mtime))
                    finally:
                        os.close(f)
            except (OSError, ValueError) as e:
                dropped[rel] = f"not restored: {type(e).__name__}: {e}"
        for rel, target in links:
            try:
                fd, name = parent(rel)
                clear(fd, name)
                os.symlink(os.fsdecode(target), name, dir_fd=fd)
            except (OSError, ValueError) as e:
                dropped[rel] = f"not restored: {type(e).__name__}: {e}"
        for rel, mode, mtime in reversed(dirs):
            try:
                fd, name = parent(rel)
                d = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _AT, dir_fd=fd)
                try:
                    os.fchmod(d, mode)
                    os.utime(d, (mtime, mtime))
                finally:
                    os.close(d)
            except (OSError, ValueError) as e:
                dropped.setdefault(rel, f"mode not restored: {type(e).__name__}: {e}")
    finally:
        for fd in opened.values():
            os.close(fd)
    return dropped
