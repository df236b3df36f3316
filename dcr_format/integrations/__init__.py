"""Integrations with inference engines and trainers (each imports its framework lazily)."""
