"""Helpers shared by tests: real audio made with espeak-ng and sox."""
