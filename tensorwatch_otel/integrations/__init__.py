"""Integrations: the transformers.debug_utils drop-in and the training frameworks. Each module
imports its framework only when used."""
