"""Pure helpers behind the KFP components (feast I/O, GX suites, step functions).

Everything here is importable and unit-testable without KFP; the component files in components/ and the
CLI in pipelines/cli.py are thin shells over `components._lib.steps`. Feast and great_expectations are
imported lazily inside functions because each import costs 3-7 s.
"""
