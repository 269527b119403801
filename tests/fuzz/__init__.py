"""Fuzz tests with a fixed budget: every wire decoder, and every tier's input path on a real broker."""
