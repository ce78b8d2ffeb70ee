"""The package's one plan cache.

A C plan (gdn_plan, gdn_layer_plan, gdn_attn_plan, gdn_moe_plan, ...) fixes shapes and options
and owns its workspace, so the Python entry points make one per configuration and reuse it:
PLANS.get(key, make, keep) returns the cached plan of key or the one make() builds, and keeps at
most `keep` plans of the key's kind (key[0]), the least recently used dropped first. A plan is a
Plan: its handle h, the config it was made from, a lock (a plan runs one call at a time) and its
destroy function, called when the last reference goes (a dropped plan still in use by a caller
lives until that call returns). Plans hold no state between calls (the saved activations and
states are the caller's arrays), so two calls of the same configuration may share one.
"""
import ctypes
import threading
from collections import OrderedDict


def config_key(cfg):
    """A ctypes struct's field values as a hashable tuple (pointers by address, arrays and nested
    structs as tuples): a cache key that, unlike the struct's bytes, ignores padding."""
    out = []
    for name, _ in cfg._fields_:
        v = getattr(cfg, name)
        if isinstance(v, ctypes._Pointer):
            v = ctypes.cast(v, ctypes.c_void_p).value
        elif isinstance(v, ctypes.Array):
            v = tuple(v)
        elif isinstance(v, ctypes.Structure):
            v = config_key(v)
        out.append(v)
    return tuple(out)


class Plan:
    """One C plan made by create(&h, &cfg) (a gdn_status, raised through _lib.check naming
    `what`); destroy(h) frees it with the object. keep: what cfg points to (cu_seqlens arrays),
    alive as long as the plan."""

    def __init__(self, create, destroy, cfg, what, keep=None):
        from . import _lib as L
        h = ctypes.c_void_p()
        L.check(create(ctypes.byref(h), ctypes.byref(cfg)), what)
        self.h, self.cfg, self.keep = h, cfg, keep
        self._destroy = destroy
        self.lock = threading.Lock()

    def __del__(self):
        if getattr(self, "h", None) and getattr(self, "_destroy", None) is not None:
            self._destroy(self.h)
            self.h = None


class PlanCache:
    """Plans by key (a tuple whose first item names the kind), least recently used first out."""

    def __init__(self):
        self._plans = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, make, keep):
        """The plan of key: the cached one, or make()'s. At most `keep` plans of key[0]'s kind stay
        cached; on a miss the oldest go before make() runs (a plan's workspace can be GBs: a
        model's kept activations), and make() runs outside the lock."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
            self._trim(key[0], keep - 1)
        plan = make()
        with self._lock:
            plan = self._plans.setdefault(key, plan)   # another thread's, if it made one first
            self._plans.move_to_end(key)
            self._trim(key[0], keep)
        return plan

    def _trim(self, kind, n):
        same = [k for k in self._plans if k[0] == kind]
        for k in same[:max(len(same) - n, 0)]:
            del self._plans[k]

    def kinds(self):
        """{kind: plans cached} (tests)."""
        with self._lock:
            out = {}
            for k in self._plans:
                out[k[0]] = out.get(k[0], 0) + 1
            return out

    def clear(self):
        with self._lock:
            self._plans.clear()


PLANS = PlanCache()
