"""Drafters: one file each, found through the registry in base.py."""
from tandem.drafters import draft_model, eagle, hybrid, mtp, ngram, self_draft, suffix  # noqa: F401  (registration)
from tandem.drafters.base import Drafter, DrafterBase, build_drafter, register, registered

__all__ = ["Drafter", "DrafterBase", "build_drafter", "register", "registered"]
