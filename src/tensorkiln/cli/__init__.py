"""The ``tensorkiln`` command line."""
