"""The cluster as a file describes it: YAML, topology, expert placement, fingerprint, launching nodes."""
