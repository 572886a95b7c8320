"""Datasets from pinned packages: prompts per domain (prompts.py) and the package readers (packages.py)."""
