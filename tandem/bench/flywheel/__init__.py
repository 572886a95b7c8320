"""The flywheel: acceptance over domain-shifting streams, Aurora's replay, and what trainer steps cost."""
