"""The agent started as a script, ``python -I /run/tangram/inside/__main__.py --reap`` (where no
copy compiled for the sandbox's interpreter is at hand: an image's own python, ``unshare``, no
isolation): the package is imported from the directory above this file, which then leaves
``sys.path`` again (the user's code must not import it by accident)."""
import sys

sys.path.insert(0, __file__.rpartition("/")[0].rpartition("/")[0] or "/")
from inside import loop  # noqa: E402

del sys.path[0]
loop.main(builtins=__builtins__)
