"""The core's codes as gRPC status codes, for every door on the gRPC port (the same names and numbers)."""

from __future__ import annotations

import grpc

from service.vocabulary.errors import Code


def grpc_code(code: Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


def core_code(code: grpc.StatusCode) -> Code:
    return Code[code.name]
