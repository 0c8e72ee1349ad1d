"""The jobs main.py runs, one module each (main.JOBS); no job imports another."""
