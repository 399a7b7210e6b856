"""Errors of the pool ledgers, in a module of their own: the ledgers are compiled (``setup.py``),
and a compiled class cannot derive from ``RuntimeError``; kept as plain Python, the error is the
same class whichever build imports it."""

from __future__ import annotations


class CapacityError(RuntimeError):
    """A decision asked for more than a pool has: always a bug in the policy, never user error."""
