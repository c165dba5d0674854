#!/usr/bin/env bash
# Regenerates the Python gRPC code from proto/asr/v1/asr.proto (committed, so the
# server runs without grpcio-tools). tests/test_proto.py checks it is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-proto}"  # PYTHON: the interpreter with grpcio-tools (default: python on PATH)
"${PYTHON:-python}" -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" proto/asr/v1/asr.proto
