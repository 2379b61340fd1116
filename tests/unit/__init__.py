"""Unit tests, laid out as the package is: ``tests/unit/<package>/test_<module>.py`` tests
``s3ckpt/<package>/<module>.py``, and ``test_<module>_<aspect>.py`` one aspect of a module
that has several files of tests; ``tests/unit/benchmarks/`` tests the benchmark harness.

These folders are packages so that test modules of one name in two folders (``dcp/`` and
``s3/``, say) import as different modules.
"""
