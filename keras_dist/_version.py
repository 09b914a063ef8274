"""The version of keras_dist (read by `keras_dist.__version__` and written into
every checkpoint's manifest)."""

__version__ = "0.1.0"
