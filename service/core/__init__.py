"""The recognition core: protocol-free domain types, errors and the Recognizer every door calls."""
