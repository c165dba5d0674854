"""What a request may ask redaction to mask (the proto's Redaction values); the masking itself is the
pipeline's (service/pipeline/redaction.py)."""

from __future__ import annotations

import enum


class Kind(enum.Enum):
    """What to redact; the names are the proto's Redaction values."""

    PCI = "[PCI]"
    SSN = "[SSN]"
    NUMBERS = "[NUMBER]"

    @property
    def placeholder(self) -> str:
        return self.value
