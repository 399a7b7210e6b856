"""The persistent shell's files (``ShellDir``) and a step's live stdin (``LiveIn``).

The agent is PID 1 of the sandbox, and the shell's directory (``DIR``) is in the sandbox's own
/tmp: its code can put anything there, a link to /proc/1/fd/4 (the agent's answer channel to the
host) included, and the agent would follow it with its own rights (a step's command text would then
go to the host as a forged answer). So the agent never opens a path there: it holds the directory's
descriptor, opened without following a link, and makes each of its files afresh under it (unlinked,
then created exclusively, never following a link).
"""

import binascii
import os
import select

DIR = "/tmp/.tangram-shell"
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
#: how the agent opens the shell's FIFOs: never blocking, never through a link
_FIFO = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
#: a live stdin's bytes the step has not read yet that the agent holds before it stops reading
#: the host's channel (the host's sender then waits: its own bound says so to its caller); one
#: message more at most (the host's pieces: ``sandbox.STDIN_PIECE``, 64 KiB)
STDIN_HELD = 1 << 20


class Tampered(OSError):
    """The shell's directory or one of its files was replaced while the agent made it."""


def _aside(name):
    """A new name to move what took ``name``'s place to (never deleted: it is the sandbox's)."""
    return f"{name}.{binascii.hexlify(os.urandom(4)).decode()}"


class ShellDir:
    """``DIR``, held by a descriptor (``fd``), and the files the agent makes under it."""

    def __init__(self):
        self.fd = None

    def open(self):
        """The descriptor of ``DIR``, a real directory of this sandbox's (made again if something
        else was put there)."""
        if self.fd is not None:
            return self.fd
        for _ in range(5):
            try:
                fd = os.open(DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                try:
                    os.mkdir(DIR, 0o700)
                except FileExistsError:
                    pass
                continue
            except PermissionError:
                raise
            except OSError:  # a link or a file in its place (ELOOP, ENOTDIR): moved aside
                try:
                    os.rename(DIR, _aside(DIR))
                except FileNotFoundError:
                    pass
                continue
            self.fd = fd
            return fd
        raise Tampered(16, "the shell's directory keeps being replaced", DIR)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def fresh(self, name, make):
        """``name`` under the shell's directory, removed and made again by ``make(name, dir_fd)``;
        raises ``Tampered`` when something else keeps taking its place."""
        d = self.open()
        for _ in range(5):
            try:
                os.unlink(name, dir_fd=d)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                os.rename(name, _aside(name), src_dir_fd=d, dst_dir_fd=d)
            try:
                return make(name, d)
            except FileExistsError:
                continue
        raise Tampered(17, "a file of the shell's keeps being replaced", f"{DIR}/{name}")

    def intact(self, fifos):
        """``Tampered`` unless ``DIR`` is still the directory held and its FIFOs the ones the agent
        reads (``fifos``: name -> a descriptor held on it), else the shell would write a step's
        output where the agent never looks."""
        d = os.fstat(self.fd)
        there = os.stat(DIR, follow_symlinks=False)
        if (there.st_dev, there.st_ino) != (d.st_dev, d.st_ino):
            raise Tampered(2, "the shell's directory was replaced", DIR)
        for name, fd in fifos.items():
            held = os.fstat(fd)
            try:
                got = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                raise Tampered(2, "the shell's FIFO was removed", f"{DIR}/{name}") from None
            if (got.st_dev, got.st_ino) != (held.st_dev, held.st_ino):
                raise Tampered(2, "the shell's FIFO was replaced", f"{DIR}/{name}")

    def write(self, name, data):
        """A regular file ``name`` in the shell's directory with ``data``, made afresh."""
        fd = self.fresh(name, lambda n, d: os.open(n, _NEW, 0o600, dir_fd=d))
        try:
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)

    def open_fifo(self, name, access):
        """``name`` in the shell's directory opened with ``access``, checked to be a FIFO (else the
        agent would read or write whatever the sandbox's code put in its place)."""
        fd = os.open(name, access | _FIFO, dir_fd=self.fd)
        if (os.fstat(fd).st_mode & 0o170000) != 0o010000:  # not the FIFO just made (S_IFIFO)
            os.close(fd)
            raise Tampered(17, "the shell's FIFO was replaced", f"{DIR}/{name}")
        return fd

    def live_in(self):
        """The step's stdin as a FIFO made afresh, held open read-write by the agent (its open by
        the step never blocks, and it ends only when the agent closes it)."""
        self.fresh("in", lambda n, d: os.mkfifo(n, 0o600, dir_fd=d))
        return self.open_fifo("in", os.O_RDWR)

    def fifos(self):
        """The step's stdout and stderr FIFOs, made afresh: ((out_r, out_w), (err_r, err_w)), the
        agent's own writer of each held so that a step's end is never an end of file."""
        fds, held = [], []
        try:
            for name in ("out", "err"):
                self.fresh(name, lambda n, d: os.mkfifo(n, 0o600, dir_fd=d))
                held.append(self.open_fifo(name, os.O_RDONLY))
                held.append(self.open_fifo(name, os.O_WRONLY))  # ours: no EOF between steps
                fds.append((held[-2], held[-1]))
        except BaseException:  # none left open in PID 1 when the making fails part-way
            for fd in held:
                os.close(fd)
            raise
        return fds


class LiveIn:
    """A running step's live stdin: the host's ``stdin`` messages read from the agent's request
    channel into the step's FIFO, as the step reads it (non-blocking, never more than
    ``STDIN_HELD`` held). A message that is not ``stdin`` is handed to ``hold`` (for the agent's
    loop, next) and the channel is read no more during this step."""

    def __init__(self, fd, channel, read_msg, hold, first=b""):
        self.fd, self.channel, self.read_msg, self.hold = fd, channel, read_msg, hold
        self.pending = bytearray(first)
        self.eof = False
        self.reading = True  # the channel is polled (False: paused while full, or done for this step)
        self.done_reading = False
        self.writing = False  # the FIFO is polled for room
        # the step's shell has opened the FIFO (it says so on the status pipe): until then the
        # agent's descriptor is its only one, and closing it for the end of file would drop what
        # is in it and leave the shell's open waiting for a writer for good
        self.opened = False

    def register(self, poll):
        poll.register(self.channel, select.POLLIN)
        self.update(poll)

    def on_channel(self, poll):
        """A message from the host while the step runs."""
        msg = self.read_msg(self.channel)
        if msg is None or msg.get("op") != "stdin":  # the host's end (the loop reads it too), or a request
            if msg is not None:
                self.hold(msg)
            self.done_reading = True
        else:
            data = msg.get("data") or b""
            if isinstance(data, (bytes, bytearray)) and not self.eof and self.fd is not None:
                self.pending += data
            self.eof = self.eof or bool(msg.get("eof"))
        self.update(poll)

    def update(self, poll):
        """Write what the FIFO takes now; close it once the host's end came and all is written;
        poll the channel and the FIFO for what is wanted next."""
        while self.pending and self.fd is not None:
            try:
                n = os.write(self.fd, self.pending[:65536])
            except BlockingIOError:
                break
            del self.pending[:n]
        if self.eof and not self.pending and self.fd is not None and self.opened:
            if self.writing:
                poll.unregister(self.fd)
                self.writing = False
            os.close(self.fd)
            self.fd = None
        want_out = bool(self.pending) and self.fd is not None
        if want_out != self.writing:
            (poll.register(self.fd, select.POLLOUT) if want_out else poll.unregister(self.fd))
            self.writing = want_out
        want_in = not self.done_reading and len(self.pending) < STDIN_HELD
        if want_in != self.reading:
            (poll.register(self.channel, select.POLLIN) if want_in else poll.unregister(self.channel))
            self.reading = want_in

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
