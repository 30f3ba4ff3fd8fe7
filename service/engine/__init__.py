"""The engine: corpus → windows → batches → the model with hooks → per-head sums (SPEC §1–5).

Pure computation: nothing here opens the database or reads settings."""
