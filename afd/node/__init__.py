"""What both node commands share: start-up through the control plane, flags, signals."""
