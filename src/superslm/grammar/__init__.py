"""grammar layer."""
