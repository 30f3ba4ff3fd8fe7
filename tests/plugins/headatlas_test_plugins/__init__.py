"""headatlas extensions from outside the package, each declared as an entry point in
pyproject.toml and read by headatlas when it first needs it: a model family (GPT-NeoX), a metric
derived from the stored sums, and an in-memory DuckDB backend."""
