"""Accelerations, passed in as objects."""
