"""The gRPC control plane: coordinator service, node client, auth, health."""
