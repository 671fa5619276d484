"""The kvfleet benchmark harness: `python -m bench` (see README.md)."""
