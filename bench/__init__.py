"""The benchmarks: each `bench/x.py` with a `main` is a script, run from the repository root
as `python -m bench.x [flags]` (`--help` says what it measures); the modules whose names
start with `_` are what they share (`_fleet`: ports, health waits, core pins; `_client`: the
streamed OpenAI client; `_envoy`, `_proxy`, `_slo`). They import each other as `bench.x`,
absolutely: `python bench/x.py` does not run a script that imports one of them (the
repository root is not on the path then; `python -m` puts it there, as pytest's
`pythonpath` does for the tests that import a benchmark's pure parts).
"""
