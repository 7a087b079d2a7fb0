"""Generated gRPC/protobuf stubs. Do not edit."""
