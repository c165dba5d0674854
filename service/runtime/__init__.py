"""Process plumbing: supervisor, gRPC and HTTP servers, ports, TLS, auth, logging."""
