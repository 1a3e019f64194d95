"""A pytest plugin for the GPU suite (``-p xdist_pin`` with ``benches/`` on ``PYTHONPATH``): each
pytest-xdist worker keeps ``LLOYAL_PIN_CORES`` cores of its own (default 2), so the contexts it
makes without ``n_threads`` take that many threads, as on a 2-core CI host, instead of every
worker taking every core of a 16-core GPU host. Runs when the worker imports it, before lloyal
loads; the controller (no ``PYTEST_XDIST_WORKER``) is left alone.
"""

from __future__ import annotations

import os

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and hasattr(os, "sched_setaffinity"):
    _per = int(os.environ.get("LLOYAL_PIN_CORES", "2"))
    _cores = sorted(os.sched_getaffinity(0))
    _first = int(_worker[2:]) * _per % max(1, len(_cores))
    os.sched_setaffinity(0, set(_cores[_first : _first + _per]) or set(_cores))
