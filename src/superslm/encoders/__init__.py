"""encoders layer."""
