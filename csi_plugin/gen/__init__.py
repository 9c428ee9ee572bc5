"""Generated gRPC stubs (see protos/compile.py). Do not edit."""
