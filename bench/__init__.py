"""semantic's benchmarks and stress harnesses, each a module run from the repository root:
``python -m bench.NAME --help`` (``make bench`` runs the suite of them through ``bench.run_all``).

Results go to ``bench/reports/<date>-<machine>-<tag>/`` as JSON and logs with a PROVENANCE.md naming
the commit and command of each; README.md and docs/performance.md quote only numbers kept there.
"""
