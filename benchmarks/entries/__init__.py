"""One module per benchmark entry, each run in its own process by `run.py`."""
