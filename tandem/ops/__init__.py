"""Pure tensor functions: no state, randomness passed in."""
