"""ARL-Tangram: action-level orchestration of the external resources of agentic RL.

Every external call of a rollout (a sandbox command, a reward/teacher model score, a rate-limited
API request) is an *action* scheduled on shared, elastic pools. State (sandbox files, model
weights) outlives the action; compute (cores, GPUs) does not.
"""

__version__ = "0.1.0"

from .build import pure_requested as _pure_requested, stale as _stale, use_sources as _use_sources

if _pure_requested():  # ARL_TANGRAM_PURE=1: the sources, even where compiled modules exist (build.py)
    _use_sources()
elif _older := _stale():  # a checkout edited (or pulled) since its last build: its compiled modules are older code
    import warnings as _warnings

    _warnings.warn("arl_tangram: compiled modules older than their sources (" + ", ".join(_older) + "); "
                   "running the sources. `pip install -e .` rebuilds them.", RuntimeWarning, stacklevel=2)
    _use_sources()
