"""Ranks: building and launching Fabric the way the user's launcher expects, and ending the run.

``build`` (the launcher in use, a Fabric for it, its collective timeout), ``teardown`` (every rank exits 0
when done and promptly non-zero on failure) and ``call_order`` (ranks that disagree on which collective
method they are in are named at once, not after a hang). The command line users add to their scripts is
``fabric_learner.cli``; the collector process (``python -m fabric_learner.collect``) lives in ``remote``.
Importing this package imports none of its modules.
"""
