"""The test suite; its folders mirror the source tree (tests/engine/..., tests/service/...,
tests/benchmarks/...), with tests/e2e (the real server) and tests/deploy (the deployment) apart.

Every folder is a package, so a test module is imported by its full name (``tests.engine.test_loader``)
with the repository root on ``sys.path``: ``tests/engine/`` never shadows the ``engine`` package, and
two folders may each hold a ``test_structured.py``.
"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the repository root
