"""Whisper's decoding rules (rules.py), as logit processors (logits.py, keyterms.py), the prompt's tokens
(prompt.py) and beam search's host-side choices (beam.py). Torch, but no model."""
