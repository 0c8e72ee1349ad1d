"""The jobs main.py runs: the shared training loop (runner), evaluators, and every job."""
