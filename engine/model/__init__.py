"""The torch side of the engine: weights, quantization, log-mel features, the Whisper model, its KV cache,
the static-shape decode step, word timings, and the model runner that executes the scheduler's plan."""
