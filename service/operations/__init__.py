"""The operations: what the library does for a front end, once, whichever front end asks.

A front end (the CLI, the Python API) turns what its user typed into a typed request
(``requests``), calls one operation, and renders what comes back: the events the operation tells
it while it works (``events``: progress, notices, estimates), its result, or a structured error
(service/errors.py: kind, parameter, value, hint), each in its own terms (``--seq-len 0`` on the
command line, ``seq_len=0`` in Python).

- ``analysis``: a corpus analysed in this process (checks, stdin, model loading, controls).
- ``runs``: a stored run found and asked a question, its options checked against its shape.
- ``planning``: a queued run planned (corpus, model identity, key, name) before it is queued.
- ``submission``: a corpus queued for the workers, and a schedule of such runs.
"""
