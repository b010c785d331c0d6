"""The package's version, apart from the package's API (``tensorkiln/__init__``) so that the
engine, which records and checks it, does not import the layers above it."""

__version__ = "0.1.0"
