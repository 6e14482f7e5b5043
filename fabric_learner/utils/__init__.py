"""What every room uses and no user calls: each module one concern, none of them importing Lightning.

``compat`` (every use of a private Lightning, torch or torchrl API, in one place, checked by
tests/test_compat.py), ``lazy`` (public names imported on first use), ``lines`` (status lines on stderr,
each written whole) and ``quiet`` (third-party warnings a user cannot act on, silenced narrowly). Importing
this package imports none of its modules, so ``import fabric_learner`` stays cheap.
"""
