"""The ``swiftkv`` verbs that need the Serve application: ``serve``, ``calibrate`` and ``fleet``.
They reach the ``swiftkv`` command through the ``swiftkv.verbs`` entry points (``pyproject.toml``),
so the library never imports this package; otherwise they are verb modules like the library's own
(``swiftkv/cli/``)."""
