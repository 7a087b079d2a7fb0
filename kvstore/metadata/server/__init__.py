"""The metadata service process: gRPC servicer, lookup port, auth, metrics."""
