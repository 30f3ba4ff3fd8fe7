"""`headatlas serve`: the stored runs as a local, read-only web app.

Every page is a renderer of the library, as the CLI and the Python API are: its numbers come from
the same functions (``service.reports.queries``, ``roles``, ``compare``, ``intervals``,
``inspection``, ``Store.list_runs``, the read-only SQL sandbox), and every page has its data as
JSON at the same address plus ``.json``, with the column names of ``headatlas … --format json``.

- ``app``: the WSGI application: routes, the 404 and 400 pages, static files.
- ``context``: a request, and what a page reads it through (links, parameters).
- ``reads``: one read transaction per request, and the library's results remembered per state of
  the database (a file's size and time, a lake's snapshot).
- ``documents``: JSON and CSV documents, as the CLI writes them.
- ``html``, ``charts``: escaping, tables with intervals, colour scales, inline SVG figures.
- ``runs_page``, ``run_page``, ``head_page``, ``compare_page``, ``sql_page``: the pages.
- ``example``: a head's matrices on one window of the run's corpus, computed with the run's model.
- ``server``: the HTTP server (the standard library's, with a pool of threads).

The JavaScript the pages use (``static/app.js``: tooltips, the example window's heatmaps, live
progress) and the style sheet ship in this package and are served from it: nothing is loaded from
elsewhere, and every page works offline.
"""
