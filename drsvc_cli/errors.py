"""The CLI's exit codes and its own errors: one table from gRPC codes to exit codes.

  0 success, 1 failure, 2 usage error, 3 retryable (operation in progress or site
  unavailable), 4 refused (a precondition failed), 5 not found.
"""
from __future__ import annotations

import grpc

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_RETRY, EXIT_REFUSED, EXIT_NOT_FOUND = 0, 1, 2, 3, 4, 5
EXIT_BY_CODE = {grpc.StatusCode.ABORTED: EXIT_RETRY, grpc.StatusCode.UNAVAILABLE: EXIT_RETRY,
                 grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_RETRY,
                 grpc.StatusCode.FAILED_PRECONDITION: EXIT_REFUSED, grpc.StatusCode.ALREADY_EXISTS: EXIT_REFUSED,
                 grpc.StatusCode.NOT_FOUND: EXIT_NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT: EXIT_USAGE,
                 grpc.StatusCode.OUT_OF_RANGE: EXIT_USAGE}


class CliError(Exception):
    """A runbook error found before or after the RPC: a message, a code name and an exit code."""
    code, exit_code = "FAILED", EXIT_FAIL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class UsageError(CliError):
    code, exit_code = "USAGE", EXIT_USAGE


class NotFoundError(CliError):
    code, exit_code = "NOT_FOUND", EXIT_NOT_FOUND


class Refused(CliError):
    code, exit_code = "FAILED_PRECONDITION", EXIT_REFUSED


class Unreachable(CliError):
    """The plugin socket does not answer: the site (or its plugin) is down."""
    code, exit_code = "UNAVAILABLE", EXIT_RETRY
