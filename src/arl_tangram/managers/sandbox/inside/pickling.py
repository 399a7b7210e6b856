"""A session's namespace to bytes and back, in the session's interpreter (``pack_here``,
``load_here``): pickled, with functions and classes defined in the session carried by their code
and modules by name. Only the standard library of the sandbox's own python is used (an image's
python may not be the server's). What pickle cannot carry (open files, sockets, threads,
generators) is named in ``dropped``, never silently different after the wake.

The agent never unpickles or unmarshals what the interpreter packed: it carries it as bytes.
"""

import io
import marshal
import os
import sys

from . import b64

REST_SKIP = ("__builtins__",)


def _rest_fn(code, name, qualname, ncells, namespace=None):
    """A function the session defined, made again from its code (its globals: the namespace it
    is loaded into, bound by ``_loader``)."""
    import types
    cells = tuple(types.CellType() for _ in range(ncells)) if ncells else None
    f = types.FunctionType(marshal.loads(code), {} if namespace is None else namespace, name, None, cells)
    f.__qualname__ = qualname
    return f


def _rest_fn_fill(f, state):
    defaults, kwdefaults, cells, fdict, module, doc = state
    f.__defaults__, f.__kwdefaults__, f.__module__, f.__doc__ = defaults, kwdefaults, module, doc
    for cell, (full, value) in zip(f.__closure__ or (), cells):
        if full:
            cell.cell_contents = value
    f.__dict__.update(fdict)


def _rest_cls(meta, name, bases, slots):
    ns = {"__module__": "__main__"}
    if slots is not None:
        ns["__slots__"] = slots
    return meta(name, bases, ns)


def _rest_cls_fill(cls, attrs):
    for k, v in attrs.items():
        setattr(cls, k, v)


#: the names a packed namespace refers to here, and the modules that held them before this
#: package (a blob packed by an earlier agent, ``runner``, or one run as a script, ``__main__``)
_HELPERS = ("_rest_fn", "_rest_fn_fill", "_rest_cls", "_rest_cls_fill")
_EARLIER = ("runner", "__main__")


def _rest_pickler(st, buf):
    import pickle
    import types
    namespace = st.namespace

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            t = type(obj)
            if t is types.ModuleType:
                st.rest_modules.add(obj.__name__)
                return __import__("importlib").import_module, (obj.__name__,)
            if t is types.FunctionType and obj.__globals__ is namespace:
                cells = []
                for c in obj.__closure__ or ():
                    try:
                        cells.append((True, c.cell_contents))
                    except ValueError:
                        cells.append((False, None))
                return (_rest_fn, (marshal.dumps(obj.__code__), obj.__name__, obj.__qualname__, len(cells)),
                        (obj.__defaults__, obj.__kwdefaults__, tuple(cells), dict(obj.__dict__), obj.__module__,
                         obj.__doc__), None, None, _rest_fn_fill)
            if (isinstance(obj, type) and obj.__module__ == "__main__"
                    and getattr(sys.modules.get("__main__"), obj.__qualname__, None) is not obj):
                slots = obj.__dict__.get("__slots__")
                slots = (slots,) if isinstance(slots, str) else (tuple(slots) if slots is not None else None)
                attrs = {k: v for k, v in obj.__dict__.items()
                         if k not in ("__dict__", "__weakref__", "__slots__", "__module__") and k not in (slots or ())}
                return (_rest_cls, (type(obj), obj.__name__, obj.__bases__, slots), attrs, None, None, _rest_cls_fill)
            return NotImplemented

    return Pickler(buf, 4)


def rest_dump(st, value):
    buf = io.BytesIO()
    _rest_pickler(st, buf).dump(value)
    return buf.getvalue()


def _loader(data, namespace):
    """``data`` unpickled, the session's own functions made again with ``namespace`` as globals."""
    import pickle

    def fn(code, name, qualname, ncells):
        return _rest_fn(code, name, qualname, ncells, namespace)

    helpers = {"_rest_fn": fn, "_rest_fn_fill": _rest_fn_fill, "_rest_cls": _rest_cls,
               "_rest_cls_fill": _rest_cls_fill}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if name in _HELPERS and (module == __name__ or module in _EARLIER):
                return helpers[name]
            return super().find_class(module, name)

    return Unpickler(io.BytesIO(data)).load()


def pack_here(st, req):
    """In the session's interpreter: its namespace, directory, environment and ``sys.path`` as
    one marshal blob (opaque to the agent), what could not be carried and the modules it holds."""
    state = {k: v for k, v in st.namespace.items() if k not in REST_SKIP}
    dropped = {}
    st.rest_modules = set()
    try:
        ns = rest_dump(st, state)
    except BaseException:  # one value cannot be carried: find which, keep the others together
        keep = {}
        for k, v in state.items():
            try:
                rest_dump(st, v)
                keep[k] = v
            except BaseException as e:
                dropped[k] = f"{type(e).__name__}: {e}"[:300]
        ns = rest_dump(st, keep)
    blob = marshal.dumps({"ns": ns, "cwd": os.getcwd(), "environ": dict(os.environ), "path": list(sys.path)}, 4)
    return {"state": b64(blob), "dropped": dropped, "modules": sorted(st.rest_modules)}


def load_here(st, req):
    """In a new session interpreter: a ``pack_here`` blob back in place."""
    state = marshal.loads(req["state"])
    dropped = {}
    try:
        ns = _loader(state["ns"], st.namespace)
    except BaseException as e:
        ns = {}
        dropped["(namespace)"] = f"could not be loaded: {type(e).__name__}: {e}"[:300]
    st.namespace.update(ns)
    os.environ.clear()
    os.environ.update(state["environ"])
    sys.path[:] = state["path"]
    try:
        os.chdir(state["cwd"])
    except OSError as e:
        dropped["(cwd)"] = f"{state['cwd']}: {e}"
    return {"dropped": dropped, "names": len(ns)}
