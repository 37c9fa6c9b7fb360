"""Compatibility shims for library releases that lack an upstream feature (see each module)."""
