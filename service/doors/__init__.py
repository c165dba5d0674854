"""The doors: each one translation layer from a protocol onto the recognition core and back."""
