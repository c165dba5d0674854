"""What the doors share and no door owns: gRPC status codes and a streaming call's life (the gRPC doors),
bounded WebSocket writes, the telephony doors' refusal and call task, bearer-token auth, subtitle formats
and the HTTP body's allowance. Every other package or module under service/doors is a door, and no door
imports another (the `doors-independent` contract in pyproject.toml)."""
