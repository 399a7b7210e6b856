"""The agent inside every sandbox: it runs what the host asks, one request at a time.

It runs under the sandbox's interpreter with the standard library only (``tests/test_inside.py``
proves it), importing as little as it can: its start-up is the cost of every fresh sandbox, so a
module a one-shot never uses is imported when its first request comes. Requests come from the
(trusted) host as length-prefixed ``marshal`` dicts; answers go back as JSON lines, which the host
parses safely even if the user's code has taken this process over (``loop``). The operations, by
module (``loop.OPS``):

* ``run``     fork+exec ``argv`` (a shell command, a compiled binary) in its own process group;
              a bash one-shot's successor started ahead (``procs``)
* ``python``  ``code`` in a child of a warm interpreter, forked from a *zygote* that never holds a
              request (``zygote``)
* ``write`` / ``read``  files in the workspace, opened as plain files only (``files``); ``run``
              and ``python`` also take ``files`` to write first and ``fetch`` paths to read after
* ``fs``      one filesystem call for the E2B API (``fsops``)
* ``reset``   make a used sandbox pristine for the next one and say whether that could be
              verified (``reset``: processes, writable places, System V IPC, keyrings, /proc)
* ``cell``    a session's python step, in the session's own interpreter (``sessions`` in this
              process, ``cells`` in that one); ``warm`` prepares a session sandbox
* ``rest`` / ``rest_chunk`` / ``wake``  a session's state to bytes and back (``rest``, and
              ``pickling`` in the session's interpreter)
* ``shell``   a step of the session's persistent shell (``shell``, ``shellio``)

Every child gets ``timeout_s``; output is captured up to ``max_output`` bytes per stream (the rest
is drained and dropped, and flagged). After each request every other process in the sandbox is
killed, so nothing an action started outlives it (the agent itself is the persistent state:
``loop.State``).

Recycling one-shot sandboxes means hostile code must not be able to reach anything that outlives
its run. The agent is PID 1 of the sandbox's PID namespace (bwrap ``--as-pid-1``), so nothing
inside can kill or stop it, and it is non-dumpable, so nothing inside can ptrace it or open its
``/proc`` files. Python one-shots are not forked from the agent itself, whose heap holds earlier
requests' code, stdin and output (a child could read them back from its copy), but from the
zygote, forked before the first request: it receives only descriptors, and the child reads its
own request after the fork.

Started by ``__main__.py`` as a script, or imported from its compiled copy (``isolation.BOOT``).
"""
