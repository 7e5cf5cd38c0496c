"""Sizing an AFD deployment: cost models measured (`afd profile`) or derived from a hardware spec, a
discrete-event simulator of the decode step, and the search `afd plan` runs over them."""
